"""Several reward functions with weights (reward.functions, reward.weights: TRL's reward_funcs and reward_weights):
the weighted sum scores, each function is logged on its own (rewards/<name>/mean and /std, in the periodic
evaluation too, and named in the summary), the single reward.function is a list of one and behaves as before, and
each bad list is one sentence and exit code 2 before anything loads. The flow test is the real flow on a tiny
Llama-style model: GRPO groups with DAPO's dynamic sampling, a Prefect test harness and a SQLite MLflow store."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from pydantic import ValidationError

from flows.pipeline import rlhf_pipeline
from flows.pipeline_command import main as pipeline_command
from flows.summary import format_summary
from rlhf.config import PipelineConfig, RewardConfig, load_config
from rlhf.rollout.reward_function import (
    RewardFunctionError,
    function_digest,
    load_reward_functions,
    reward_function,
)
from tests.conftest import REPO

pytestmark = pytest.mark.xdist_group("reward_functions")  # one Prefect test harness for the module's flow runs
HERE = __name__


def parity(prompts, completions, item):
    """1 where a response's length in characters has the parity of its row's `item`, else 0."""
    return [float((len(c) + n) % 2 == 0) for c, n in zip(completions, item, strict=True)]


def short(prompts, completions):
    """1 for a response of at most 12 characters, else 0."""
    return [float(len(c) <= 12) for c in completions]


def length(prompts, completions):
    return [float(len(c)) for c in completions]


def tagged(prompts, completions, item):
    """The row's item: a function with categories, as IFEval's verifiers have."""
    return [float(n) for n in item]


tagged.categories = lambda item: [["even" if n % 2 == 0 else "odd"] for n in item]


def test_the_score_is_the_weighted_sum_and_each_function_keeps_its_own():
    functions = load_reward_functions([f"{HERE}:length", f"{HERE}:short", f"{HERE}:length"], [0.5, -2.0, 1.0])
    prompts, responses = ["p", "q"], ["abc", "a" * 20]
    assert functions.names == ["length", "short", "length_2"]
    parts = functions.parts(prompts, responses)
    assert parts == [[3.0, 20.0], [1.0, 0.0], [3.0, 20.0]]
    assert functions(prompts, responses) == [0.5 * 3 - 2.0 + 3.0, 0.5 * 20 + 20.0]
    assert functions.spec == f"{HERE}:length, {HERE}:short, {HERE}:length"


def test_a_bad_return_names_the_function_of_the_list():
    def broken(prompts, completions):
        return [math.nan] * len(completions)

    functions = load_reward_functions([f"{HERE}:short"], None)
    bad = type(functions)((functions.functions[0], functions.functions[0].__class__("mine:broken", broken)), (1.0, 1.0))
    with pytest.raises(RewardFunctionError) as err:
        bad(["p"], ["r"])
    assert str(err.value).startswith("reward function mine:broken returned nan for row 0")


def test_the_single_function_is_a_list_of_one_and_unchanged():
    one = RewardConfig(source="function", function=f"{HERE}:short")
    listed = RewardConfig(source="function", functions=[f"{HERE}:short"])
    assert one.function_specs == listed.function_specs == [f"{HERE}:short"]
    assert one.function_weights == listed.function_weights == [1.0]
    # the cache key of a single function is the digest it always had
    assert function_digest(f"{HERE}:short") == function_digest([f"{HERE}:short"], [1.0])
    assert function_digest([f"{HERE}:short"], [2.0]) != function_digest(f"{HERE}:short")
    assert function_digest([f"{HERE}:short", f"{HERE}:length"]) != function_digest([f"{HERE}:length", f"{HERE}:short"])
    fn, weight = reward_function(one)
    assert fn is not None and fn.names == ["short"] and fn.weights == (1.0,) and weight == 1.0
    # beside a reward model: the one function at function_weight; a list at its own weights
    fn, weight = reward_function(RewardConfig(function=f"{HERE}:short", function_weight=0.3))
    assert fn is not None and fn.weights == (1.0,) and weight == 0.3
    fn, weight = reward_function(RewardConfig(functions=[f"{HERE}:short", f"{HERE}:length"], weights=[0.3, 0.1]))
    assert fn is not None and fn.weights == (0.3, 0.1) and weight == 1.0
    assert reward_function(RewardConfig(function=f"{HERE}:short"))[0] is None  # function_weight 0: left out
    # the alarm calls the reward the gold itself only where it is the gold reward alone, at weight 1
    assert listed.is_the_gold(f"{HERE}:short")
    assert not RewardConfig(source="function", functions=[f"{HERE}:short"], weights=[2.0]).is_the_gold(f"{HERE}:short")
    two = RewardConfig(source="function", functions=[f"{HERE}:short", f"{HERE}:length"])
    assert not two.is_the_gold(f"{HERE}:short")


def test_categories_come_from_the_function_that_has_them():
    from rlhf.rollout.rows import RowColumns

    functions = load_reward_functions([f"{HERE}:short", f"{HERE}:tagged"], [1.0, 0.0])
    assert functions.has_categories
    columns = RowColumns(["item"], {"a": ["2"], "b": ["3"]}, "two rows")
    assert functions.with_columns(columns).categories(["a", "b"]) == [["even"], ["odd"]]
    assert not load_reward_functions([f"{HERE}:short"]).has_categories


@pytest.mark.parametrize(
    "overrides, sentence",
    [
        (
            [f"reward.functions=[{HERE}:short,{HERE}:length]", "reward.weights=[1.0]"],
            "reward.weights has 1 values for the 2 functions of reward.functions: give one weight per function, or "
            "leave reward.weights out (all 1)",
        ),
        (
            [f"reward.functions=[{HERE}:short,{HERE}:length]", "reward.weights=[1.0,.inf]"],
            "reward.weights.1 is inf, not a finite number; give it a finite value",
        ),
        (
            [f"reward.functions=[{HERE}:short]", "reward.weights=[.nan]"],
            "reward.weights.0 is nan, not a finite number; give it a finite value",
        ),
        (
            [f"reward.function={HERE}:short", f"reward.functions=[{HERE}:length]"],
            "reward.function and reward.functions both name reward functions: set one of them (a list of one is "
            "reward.function)",
        ),
        (["reward.functions=[]"], "reward.functions is empty: list 'module:callable' names, or leave the key out"),
        (
            [f"reward.function={HERE}:short", "reward.weights=[2.0]"],
            "reward.weights weighs the entries of reward.functions: list them there",
        ),
        (
            [f"reward.functions=[{HERE}:short,no_such_module_here:f]"],
            "reward.functions[1]: module 'no_such_module_here' of no_such_module_here:f cannot be imported "
            "(ModuleNotFoundError: No module named 'no_such_module_here'); it must be importable in the run's "
            "environment (installed, or on PYTHONPATH)",
        ),
        (
            [f"reward.functions=[{HERE}:short,{HERE}:parity]"],
            f"reward.functions[1]: {HERE}:parity takes the keyword argument 'item', which names no column of "
            "data.row_columns (kept: none); add the data set's column to data.row_columns or remove the argument",
        ),
    ],
)
def test_a_bad_list_is_one_sentence_and_exit_code_2_before_anything_loads(tmp_path, capsys, overrides, sentence):
    args = ["--config", str(REPO / "conf" / "smoke.yaml"), "reward.source=function", *overrides]
    args += [f"runtime.output_dir={tmp_path}/out", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    assert pipeline_command(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(sentence), lines
    assert "Traceback" not in err and not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()


def test_the_prefect_form_takes_the_list():
    schema = PipelineConfig.model_json_schema()
    reward = schema["$defs"]["RewardConfig"]["properties"]
    assert {"type": "array", "items": {"type": "string"}} in reward["functions"]["anyOf"]
    assert {"type": "array", "items": {"type": "number"}} in reward["weights"]["anyOf"]
    with pytest.raises(ValidationError):
        RewardConfig(source="function", functions=[f"{HERE}:short"], weights=[1.0, 2.0])
    with pytest.raises(ValidationError, match="finite"):  # built in code, as a sweep's variant is
        RewardConfig(source="function", functions=[f"{HERE}:short"], weights=[math.inf])


def _rows(n: int, start: int = 0) -> list[dict]:
    return [
        {"prompt": f"Item {i}: tell me about bees.", "chosen": "Bees hum.", "rejected": "Bees, yes.", "item": i}
        for i in range(start, start + n)
    ]


def test_several_functions_train_through_groups_and_dynamic_sampling_each_logged(harness, tmp_path, family_checkpoint):
    for name, rows in (("train", _rows(24)), ("eval", _rows(8, start=100))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    weights = [1.0, 0.25]
    cfg = load_config(
        REPO / "conf" / "smoke.yaml",
        [
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.artifact_location={tmp_path}/artifacts",
            f"runtime.output_dir={tmp_path}/out",
            "data.source=local",
            f"data.path={tmp_path}/train.jsonl",
            f"data.eval_path={tmp_path}/eval.jsonl",
            "data.format=explicit",
            "data.row_columns=[item]",
            f"sft.model={family_checkpoint('llama')}",
            "reward.source=function",
            f"reward.functions=[{HERE}:parity,{HERE}:short]",
            f"reward.weights={json.dumps(weights)}",
            "ppo.advantage_estimator=dapo",  # groups of samples_per_prompt, and dynamic sampling
            "ppo.samples_per_prompt=4",
            "ppo.total_episodes=16",
            "ppo.batch_size=8",
            "ppo.num_mini_batches=1",
            "ppo.max_new_tokens=6",
            "ppo.missing_eos_penalty=null",
            "ppo.overlong_buffer=0",
            "ppo.eval_every=1",
            "ppo.eval_n_prompts=4",
            "eval.n_prompts=4",
            "eval.batch_size=4",
        ],
    )
    summary = rlhf_pipeline(cfg)
    client = MlflowClient(cfg.tracking.uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    (run,) = client.search_runs([experiment], "tags.stage = 'train_policy_ppo'")
    history = {
        key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
        for key in (
            "objective/scores",
            "rewards/parity/mean",
            "rewards/parity/std",
            "rewards/short/mean",
            "rewards/short/std",
            "dynamic_sampling/generated_episodes",
            "periodic_eval/rewards/parity/mean",
            "periodic_eval/rewards/short/mean",
            "periodic_eval/score",
        )
    }
    assert len(history["rewards/parity/mean"]) == len(history["objective/scores"]) == 2  # every update
    assert all(n >= 8 for n in history["dynamic_sampling/generated_episodes"])
    trained = zip(
        history["objective/scores"], history["rewards/parity/mean"], history["rewards/short/mean"], strict=True
    )
    for score, p, s in trained:
        assert 0 <= p <= 1 and 0 <= s <= 1
        assert score == pytest.approx(weights[0] * p + weights[1] * s, abs=1e-5)  # the batch trained on
    assert all(0 <= v <= 0.5 for v in history["rewards/parity/std"] + history["rewards/short/std"])
    for score, p, s in zip(
        history["periodic_eval/score"],
        history["periodic_eval/rewards/parity/mean"],
        history["periodic_eval/rewards/short/mean"],
        strict=True,
    ):
        assert score == pytest.approx(weights[0] * p + weights[1] * s, abs=1e-5)
    # the summary names each function with its last mean
    assert summary["rewards/parity/mean"] == pytest.approx(history["rewards/parity/mean"][-1])
    printed = format_summary(summary)
    line = next(line for line in printed.splitlines() if line.startswith("reward functions"))
    assert f"parity {history['rewards/parity/mean'][-1]:.3f}, short {history['rewards/short/mean'][-1]:.3f}" in line
    # the evaluation stage: each function's own scores beside the weighted one, for both policies
    frame = pd.read_parquet(summary["completions"])
    for who in ("sft", "policy"):
        parts = frame[f"{who}_reward_parity"] * weights[0] + frame[f"{who}_reward_short"] * weights[1]
        assert parts.tolist() == pytest.approx(frame[f"{who}_score"].tolist(), abs=1e-5)
        assert summary[f"eval/{who}_rewards/short"] == pytest.approx(frame[f"{who}_reward_short"].mean())
