"""Reward functions that see the row (rlhf/data/row_columns.py, rlhf/rollout/rows.py): data.row_columns kept through
preparation and in the digest, each value reaching its own sample by its row's key in PPO's groups, under dynamic
sampling, in the periodic evaluation and in the evaluation stage (a tiny Llama-style model with a chat template), two
rows with the same prompt each with its own truth, and the errors, one sentence each."""

from __future__ import annotations

import json
import sys
import textwrap

import pandas as pd
import pytest

from rlhf.config import DataConfig, EvalConfig, PipelineConfig, PPOConfig, RewardConfig, RuntimeConfig
from rlhf.data.prepare import gold_scorer, prepare_preferences
from rlhf.data.source_checks import check_source
from rlhf.errors import ConfigError, DataError
from rlhf.eval.evaluate import evaluate_policies
from rlhf.ppo.run import PolicyInputs
from rlhf.ppo.trainer import train_ppo
from rlhf.preflight import check_reward_function
from rlhf.rollout.reward_function import load_reward_function
from rlhf.rollout.rows import PromptRows, RowColumns, file_columns

RUNTIME = RuntimeConfig(device="cpu", progress=False)
SCORED: list[tuple[str, int]] = []  # (prompt, item) of every sample `item_reward` scored


def item_reward(prompts, completions, item, tags):
    """A reward function that takes two row columns; it fails the run if a sample gets another row's values."""
    for prompt, number, tag in zip(prompts, item, tags, strict=True):
        assert f"Item {number}:" in prompt and tag == {"n": number, "even": number % 2 == 0}, (prompt, number, tag)
        SCORED.append((prompt, number))
    return [float(len(c) % 5) for c in completions]  # varied, so dynamic sampling keeps groups


# its rows' categories (as rlhf.data.verifiers:ifeval_strict's are its instruction types): the PPO stage breaks its
# groups without spread down by them
item_reward.categories = lambda item, tags: [["even" if tag["even"] else "odd", "item"] for tag in tags]


def _rows(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "prompt": f"Item {i}: tell me about bees.",
            "chosen": "Bees hum.",
            "rejected": "Bees, yes.",
            "item": i,
            "tags": {"n": i, "even": i % 2 == 0},  # nested: a dict
        }
        for i in range(start, start + n)
    ]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _data(tmp_path, rows: list[dict] | None = None, **kw) -> DataConfig:
    train = _write(tmp_path / "train.jsonl", rows or _rows(24))
    held = _write(tmp_path / "eval.jsonl", _rows(8, start=100))
    return DataConfig(source="local", path=train, eval_path=held, row_columns=["item", "tags"], **kw)


def test_preparation_keeps_the_named_columns_and_they_key_the_data(tmp_path):
    prepared = prepare_preferences(_data(tmp_path), tmp_path / "prepared")
    for name in ("train", "eval", "prompts"):
        assert file_columns(tmp_path / "prepared" / f"{name}.parquet") == ["item", "tags"]
    assert file_columns(tmp_path / "prepared" / "sft.parquet") == []
    columns = RowColumns.read(prepared.prompts, prepared.eval)
    key = {p: k for path in (prepared.prompts, prepared.eval) for p, k in zip(*PromptRows.read(path), strict=True)}
    prompts = ["Item 3: tell me about bees.", "Item 101: tell me about bees.", "Item 3: tell me about bees."]
    assert columns.values([key[p] for p in prompts], ["tags", "item"]) == {
        "tags": [{"n": 3, "even": False}, {"n": 101, "even": False}, {"n": 3, "even": False}],
        "item": [3, 101, 3],
    }
    with pytest.raises(DataError, match="the row 'no such key' is not in"):
        columns.values(["no such key"], ["item"])
    # a changed value of a kept column is a changed data set: another digest, so every later stage reruns
    rows = _rows(24)
    rows[5]["tags"]["even"] = not rows[5]["tags"]["even"]
    assert prepare_preferences(_data(tmp_path, rows), tmp_path / "changed").digest != prepared.digest
    plain = prepare_preferences(DataConfig(source="local", path=str(tmp_path / "train.jsonl")), tmp_path / "plain")
    assert RowColumns.read(plain.prompts) is None


def test_a_column_the_data_lacks_is_one_sentence_naming_the_column_and_the_file(tmp_path):
    cfg = _data(tmp_path).model_copy(update={"row_columns": ["item", "answer"]})
    with pytest.raises(DataError) as err:
        check_source(cfg)
    assert str(err.value).startswith(f"data.row_columns: column 'answer' is not in {tmp_path / 'train.jsonl'}")


def test_a_keyword_argument_that_names_no_column_is_refused_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "user_rewards_kw.py").write_text(
        textwrap.dedent(
            """
            def needs_answer(prompts, completions, answer):
                return [1.0] * len(prompts)

            def optional_answer(prompts, completions, answer=None, **kwargs):
                return [1.0] * len(prompts)
            """
        )
    )
    sys.modules.pop("user_rewards_kw", None)
    data = _data(tmp_path)
    config = PipelineConfig(data=data, reward=RewardConfig(source="function", function="user_rewards_kw:needs_answer"))
    with pytest.raises(ConfigError) as err:
        check_reward_function(config)
    assert str(err.value).startswith(
        "reward.function: user_rewards_kw:needs_answer takes the keyword argument 'answer', which names no column of "
        "data.row_columns (kept: item, tags)"
    )
    optional = config.model_copy(
        update={"reward": RewardConfig(source="function", function="user_rewards_kw:optional_answer")}
    )
    check_reward_function(optional)  # a default or **kwargs takes what there is
    gold = data.model_copy(update={"gold_reward": "user_rewards_kw:needs_answer"})
    with pytest.raises(ConfigError, match="data.gold_reward: user_rewards_kw:needs_answer takes the keyword argument"):
        check_source(gold)


def test_a_two_argument_function_is_called_as_before(tmp_path):
    prepared = prepare_preferences(_data(tmp_path), tmp_path / "prepared")
    fn = load_reward_function("rlhf.data.synthetic:gold_reward").with_columns(RowColumns.read(prepared.prompts))
    assert fn.column_kwargs(["anything"]) == {}  # no lookup at all: the key need not be a row's
    assert len(fn(["Item 3: tell me about bees."], ["Bees hum."])) == 1


def test_an_unknown_instruction_id_is_named_by_its_row_before_any_model_loads(tmp_path):
    rows = [
        {
            "prompt": f"p{i}",
            "chosen": "a",
            "rejected": "b",
            "instruction_id_list": ["punctuation:no_comma"],
            "kwargs": [{}],
        }
        for i in range(6)
    ]
    rows[4]["instruction_id_list"] = ["punctuation:no_commas"]
    path = _write(tmp_path / "ifeval.jsonl", rows)
    cfg = DataConfig(
        source="local",
        path=path,
        row_columns=["instruction_id_list", "kwargs"],
        gold_reward="rlhf.data.verifiers:ifeval_strict",
    )
    with pytest.raises(DataError) as err:
        prepare_preferences(cfg, tmp_path / "prepared")
    assert "row 4 of" in str(err.value) and "unknown ifeval instruction id 'punctuation:no_commas'" in str(err.value)


def test_each_sample_gets_its_rows_values_in_groups_dynamic_sampling_and_the_evaluation(tmp_path, family_checkpoint):
    """DAPO (groups of 4, dynamic sampling) with a periodic evaluation, then the evaluation stage with a benchmark:
    `item_reward` asserts on every sample that the values it got are its own row's."""
    model = str(family_checkpoint("llama"))
    data_cfg = _data(tmp_path, tokenizer=model, gold_reward=f"{__name__}:item_reward")
    data_cfg = data_cfg.model_copy(update={"format": "explicit"})
    prepared = prepare_preferences(data_cfg, tmp_path / "prepared")
    reward_cfg = RewardConfig(source="function", function=f"{__name__}:item_reward")
    ppo = PPOConfig(
        advantage_estimator="dapo",  # groups and dynamic sampling
        samples_per_prompt=4,
        batch_size=8,
        num_mini_batches=1,
        total_episodes=16,
        max_new_tokens=6,
        eval_every=1,
        eval_n_prompts=4,
        record_rollouts=False,
    )
    SCORED.clear()
    inputs = PolicyInputs.prepared(
        ppo, RUNTIME, 0, prepared.folder, policy_path=model, reward_path=None, out_dir=str(tmp_path / "ppo"),
        reward=reward_cfg,
    )  # fmt: skip
    steps: dict[int, dict[str, float]] = {}
    result = train_ppo(inputs.policy_run(log=lambda metrics, step: steps.setdefault(step, {}).update(metrics)))
    trained = {item for _, item in SCORED if item < 100}
    held = {item for _, item in SCORED if item >= 100}
    assert len(trained) >= 4 and len(held) == 4  # rollouts (training rows) and periodic evaluations (held-out rows)
    assert [steps[u]["dynamic_sampling/generated_episodes"] >= 8 for u in (1, 2)] == [True, True]  # at each update
    for u in (1, 2):  # each group counted under each category of its row: every group is an 'item'
        by_category = {k: v for k, v in steps[u].items() if k.startswith("group/zero_std_fraction/")}
        assert set(by_category) <= {f"group/zero_std_fraction/{c}" for c in ("even", "odd", "item")}
        assert "group/zero_std_fraction/item" in by_category and all(0 <= v <= 1 for v in by_category.values())
    bench = tmp_path / "bench.jsonl"
    bench.write_text(
        "".join(
            json.dumps(
                {
                    "key": str(i),
                    "prompt": f"Say hi {i}.",
                    "instruction_id_list": ["punctuation:no_comma"],
                    "kwargs": [{}],
                }
            )
            + "\n"
            for i in range(5)
        )
    )
    SCORED.clear()
    eval_cfg = EvalConfig(
        n_prompts=6, batch_size=4, benchmarks=[{"name": "toy", "path": str(bench), "verifier": "ifeval"}]
    )
    logged: dict[str, float] = {}
    side = tmp_path / "sft_side"  # the SFT policy's side, written by this evaluation for the next
    out = evaluate_policies(
        eval_cfg, ppo, RUNTIME, result.policy_path, model, None, prepared.eval, tmp_path / "eval",
        gold_scorer(prepared.manifest, prepared.folder), lambda metrics, step: logged.update(metrics), reward_cfg,
        sft_side=side,
    )  # fmt: skip
    assert {item for _, item in SCORED} == set(range(100, 106))  # the scores and the gold, held-out rows only
    first_calls = len(SCORED)
    assert out.summary["benchmark/toy/n_prompts"] == 5 and "benchmark/toy/gain/prompt_strict_lo" in logged
    assert (tmp_path / "eval" / "benchmark-toy.md").read_text().startswith("# toy")
    verdicts = pd.read_parquet(tmp_path / "eval" / "benchmark-toy.parquet")
    assert sorted(verdicts["policy"].unique()) == ["policy", "sft"] and len(verdicts) == 10

    # a second evaluation with the same inputs reads the SFT side instead of sampling it: every figure the same
    SCORED.clear()
    again = evaluate_policies(
        eval_cfg, ppo, RUNTIME, result.policy_path, model, None, prepared.eval, tmp_path / "again",
        gold_scorer(prepared.manifest, prepared.folder), lambda metrics, step: None, reward_cfg, sft_side=side,
    )  # fmt: skip
    assert (out.sft_reused, again.sft_reused) == (False, True)
    assert len(SCORED) == first_calls - 6  # the SFT policy's 6 responses were not scored again
    assert pd.Series(again.summary).equals(pd.Series(out.summary))
    pd.testing.assert_frame_equal(pd.read_parquet(again.completions), pd.read_parquet(out.completions))
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "again" / "benchmark-toy.parquet"), verdicts)


def test_the_run_knows_when_its_reward_is_the_gold_reward_itself(tmp_path, family_checkpoint):
    """The alarm says 'games its reward' of a proxy and 'drifts without gaining' of the gold reward itself
    (`RewardConfig.is_the_gold`): the policy run is told which, from the prepared data's gold reward."""
    model = str(family_checkpoint("llama"))
    gold = f"{__name__}:item_reward"
    data_cfg = _data(tmp_path, tokenizer=model, gold_reward=gold).model_copy(update={"format": "explicit"})
    prepared = prepare_preferences(data_cfg, tmp_path / "prepared")
    ppo = PPOConfig(samples_per_prompt=2, batch_size=4, total_episodes=4, advantage_estimator="grpo")
    for function, is_gold in ((gold, True), ("rlhf.data.synthetic:gold_reward", False)):
        reward_cfg = RewardConfig(source="function", function=function)
        inputs = PolicyInputs.prepared(
            ppo, RUNTIME, 0, prepared.folder, policy_path=model, reward_path=None, out_dir=str(tmp_path / "ppo"),
            reward=reward_cfg,
        )  # fmt: skip
        assert inputs.policy_run().reward_is_gold is is_gold
    assert not RewardConfig(source="model", function=gold, function_weight=0.5).is_the_gold(gold)  # a model scores too


TRUTHS: list[list[int]] = []  # the `item` of each call of `truth_reward`, in order


def truth_reward(prompts, completions, item):
    """Records the truths it is given; its prompts are all alike, so only the row's key can tell them apart."""
    TRUTHS.append(list(item))
    return [float(len(c) % 5) for c in completions]


def test_two_rows_with_the_same_prompt_keep_their_own_truths(tmp_path, family_checkpoint):
    """Twelve training rows of two prompts and four held-out rows of one, each with its own `item`: preparation keeps
    them all, each rollout group of GRPO's gets its own row's truth, and the periodic evaluation, the evaluation stage
    and the gold reward score every held-out row against its own (a lookup by the prompt's text gave every row of a
    prompt its first row's truth)."""
    model = str(family_checkpoint("llama"))
    topic = ["bees", "ants"]
    rows = [
        {"prompt": f"Tell me about {topic[i // 6]}.", "chosen": f"Yes {i}.", "rejected": "No.", "item": i}
        for i in range(12)
    ]
    held = [
        {"prompt": "Tell me about wasps.", "chosen": f"Yes {i}.", "rejected": "No.", "item": i} for i in range(100, 104)
    ]
    cfg = DataConfig(
        source="local", path=_write(tmp_path / "train.jsonl", rows), eval_path=_write(tmp_path / "eval.jsonl", held),
        format="explicit", row_columns=["item"], tokenizer=model, gold_reward=f"{__name__}:truth_reward",
    )  # fmt: skip
    prepared = prepare_preferences(cfg, tmp_path / "prepared")
    assert prepared.manifest["rows"]["prompts"] == 12  # one PPO prompt per row, not per distinct prompt text
    reward_cfg = RewardConfig(source="function", function=f"{__name__}:truth_reward")
    ppo = PPOConfig(
        advantage_estimator="grpo", samples_per_prompt=4, batch_size=8, num_mini_batches=1, total_episodes=16,
        max_new_tokens=4, eval_every=2, eval_n_prompts=4,
    )  # fmt: skip
    inputs = PolicyInputs.prepared(
        ppo, RUNTIME, 0, prepared.folder, policy_path=model, reward_path=None, out_dir=str(tmp_path / "ppo"),
        reward=reward_cfg,
    )  # fmt: skip
    TRUTHS.clear()
    result = train_ppo(inputs.policy_run())
    rollouts = [call for call in TRUTHS if len(call) == 8]  # two groups of 4 an update
    assert len(rollouts) == 2 and all(len(set(c[:4])) == len(set(c[4:])) == 1 for c in rollouts)
    assert len({item for call in rollouts for item in call}) == 4  # four groups, four rows, whatever their prompt
    assert [sorted(call) for call in TRUTHS if len(call) == 4] == [[100, 101, 102, 103]] * 2  # periodic evaluations
    TRUTHS.clear()
    evaluate_policies(
        EvalConfig(n_prompts=4, batch_size=4), ppo, RUNTIME, result.policy_path, model, None, prepared.eval,
        tmp_path / "eval", gold_scorer(prepared.manifest, prepared.folder), lambda metrics, step: None, reward_cfg,
    )  # fmt: skip
    scored, gold = [c for c in TRUTHS if len(c) == 4], [c[0] for c in TRUTHS if len(c) == 1]
    assert [sorted(call) for call in scored] == [[100, 101, 102, 103]] * 2  # the SFT policy and the trained one
    assert sorted(gold[:4]) == sorted(gold[4:]) == [100, 101, 102, 103]  # each policy's responses, each row's own
