"""Recorded rollouts re-scored by models the run never optimised (rlhf.sweeps.rollout_rescore): the SFT model's
per-token surprisal against a direct forward, a monitor standardised on held-out pairs, the per-run signals, and
the whole table read back from a real MLflow store (SQLite in a temporary folder) with tiny real models."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from rlhf.models.loading import load_causal_lm, load_reward_model, load_tokenizer
from rlhf.models.reward_ensemble import ENSEMBLE_FILE
from rlhf.sweeps import rollout_rescore
from rlhf.sweeps.rollout_rescore import Monitor, rescore_rollouts, rollout_files, run_signals
from rlhf.tracking.client import Tracker
from tests.model_zoo import cached_family

PROMPTS = ["Review of The Quiet Sea:", "Review of Night Train:", "Review of A Long Road:"]
RESPONSES = [" the plot was excellent.", " the music was music was excellent and the", ""]
PAIRS = pd.DataFrame(
    {
        "prompt": PROMPTS * 2,
        "chosen": [" the plot was excellent.", " a fine film.", " loved it."] * 2,
        "rejected": [" dull.", " the plot was poor and slow.", " not good at all."] * 2,
    }
)


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory) -> str:
    """A reward-model checkpoint (a causal LM's fresh scalar head, saved, so every load has the same head)."""
    folder = tmp_path_factory.mktemp("reward")
    source = str(cached_family("qwen2"))
    load_reward_model(source, torch.device("cpu")).save_pretrained(folder)
    load_tokenizer(source).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def sft():
    path = str(cached_family("llama"))
    return load_causal_lm(path, torch.device("cpu")).eval(), load_tokenizer(path)


def test_token_surprisal_is_the_sft_models_own_log_probability_of_each_response_token(sft):
    model, tokenizer = sft
    rows = rollout_rescore.token_surprisal(model, tokenizer, PROMPTS, RESPONSES)
    assert [len(r) for r in rows][2] == 0  # an empty response has no tokens
    for prompt, response, got in zip(PROMPTS, RESPONSES, rows, strict=True):
        prompt_ids = tokenizer(prompt).input_ids  # with its BOS, as the batch has it
        response_ids = tokenizer(response, add_special_tokens=False).input_ids
        ids = torch.tensor([prompt_ids + response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        assert len(got) == len(response_ids)
        if response_ids:  # one row alone and in a padded batch of three agree
            want = torch.stack([-logp[len(prompt_ids) + i - 1, t] for i, t in enumerate(response_ids)])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_monitor_is_standardised_on_the_held_out_pairs(tmp_path, reward_path):
    path = reward_path
    monitor = Monitor.load(path, PAIRS)
    held_out = monitor.scores(PAIRS["prompt"].tolist() * 2, PAIRS["chosen"].tolist() + PAIRS["rejected"].tolist())
    torch.testing.assert_close(held_out.mean(1), torch.zeros(1), atol=1e-5, rtol=0)
    torch.testing.assert_close(held_out.std(1), torch.ones(1), atol=1e-5, rtol=0)
    # an ensemble folder: each member standardised on its own
    (tmp_path / ENSEMBLE_FILE).write_text(
        json.dumps(
            {
                "members": [path, str(cached_family("llama"))],
                "offsets": [0, 0],
                "in_distribution_std": 0.1,
                "member_digests": ["a", "b"],
            }
        )
    )
    pair = Monitor.load(str(tmp_path), PAIRS)
    assert pair.scores(PROMPTS, RESPONSES).shape == (2, 3)
    assert len(pair.members) == 2
    torch.testing.assert_close(pair.means[0], monitor.means[0])  # member 0 is the single model above
    assert not torch.allclose(pair.means[1], pair.means[0])


def _write_rollouts(folder, updates: dict[int, list[str]], gold: list[float]) -> None:
    (folder / "rollouts").mkdir(parents=True)
    for (update, responses), g in zip(updates.items(), gold, strict=True):
        frame = pd.DataFrame(
            {"prompt": PROMPTS[: len(responses)], "response": responses, "gold_score": g, "score": 1.0}
        )
        frame.to_parquet(folder / "rollouts" / f"update_{update:05d}.parquet")


def test_rescored_updates_and_the_signals_of_one_run(tmp_path, sft, reward_path):
    good = [" the plot was excellent.", " the acting was fine.", " a good film."]
    broken = [" excellent excellent xz qq excellent", " excellent excellent xz qq excellent", " qq xz excellent"]
    _write_rollouts(tmp_path, {1: good, 2: good, 5: good, 10: broken}, [0.5, 0.6, 0.8, -1.0])
    files = rollout_files(tmp_path, every=5)
    assert [u for u, _ in files] == [1, 5, 10]  # the first update and every fifth
    updates = rescore_rollouts(files, sft, Monitor.load(reward_path, PAIRS))
    assert updates["update"].tolist() == [1, 5, 10] and updates["gold"].tolist() == pytest.approx([0.5, 0.8, -1.0])
    assert updates["surprisal"].iloc[0] == updates["surprisal"].iloc[1]  # the same texts
    assert ((updates["surprisal_tail"] >= 0) & (updates["surprisal_tail"] <= 1)).all()
    signals = run_signals(updates)
    rise = max(0.0, *(updates["surprisal"].iloc[1:] - updates["surprisal"].iloc[0]))
    assert signals["signal: rollout surprisal (rise)"] == pytest.approx(rise)
    # hand-made: the monitor peaks at update 5 and falls 1.5 below it; the tail grows by 0.3
    made = pd.DataFrame(
        {
            "update": [1, 5, 10],
            "surprisal": [2.0, 2.5, 2.2],
            "surprisal_tail": [0.1, 0.1, 0.4],
            "monitor": [0.0, 1.0, -0.5],
        }
    )
    assert run_signals(made) == pytest.approx(
        {
            "signal: rollout surprisal (rise)": 0.5,
            "signal: rollout surprisal tail (rise)": 0.3,
            "signal: monitor (fall from its best)": 1.5,
        }
    )
    assert "signal: monitor (fall from its best)" not in run_signals(made.drop(columns="monitor"))


def test_the_table_reads_each_runs_rollouts_sft_model_and_data_from_the_store(tmp_path, capsys, reward_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "rlhf-ppo")
    data = tmp_path / "data"
    data.mkdir()
    PAIRS.to_parquet(data / "eval.parquet")
    sft_path = str(cached_family("llama"))
    good = [" the plot was excellent.", " the acting was fine.", " a good film."]
    for name, gold in (("grid-00", [0.1, 0.9, -0.8]), ("grid-01", [0.1, 0.8, 0.85])):
        out = tmp_path / name
        _write_rollouts(out, {1: good, 5: good, 10: good}, gold[:3])
        parent = tracker.start_run(name, tags={"sft_checkpoint": sft_path, "data": str(data)})
        stage = tracker.start_run(f"{name}/ppo", parent, tags={"stage": "train_policy_ppo", "output_dir": str(out)})
        tracker.log_params(stage, {"ppo.advantage_estimator": "grpo", "ppo.kl_coef": 0.05, "seed": name[-1]})
        for step, g in zip((0, 10, 20), gold, strict=True):
            steady = {"kl": step / 10, "distinct_2": 0.3, "identical_share": 0.0, "near_identical_share": 0.0}
            steady |= {"repetition": 0.1, "score_std": 0.8, "ref_surprisal": 1.0, "score": 1.0 + step / 10, "gold": g}
            tracker.log_metrics(stage, {f"periodic_eval/{k}": v for k, v in steady.items()}, step)
        tracker.end_run(stage)
        tracker.end_run(parent)
    table, updates = rollout_rescore.rescore_table(tracker, "rlhf-ppo", reward_path, "grid")
    assert sorted(table["run"]) == ["grid-00/ppo", "grid-01/ppo"]
    assert table.set_index("run")["falls"].to_dict() == {"grid-00/ppo": True, "grid-01/ppo": False}
    assert len(updates) == 6 and set(updates["run"]) == {"grid-00/ppo", "grid-01/ppo"}
    assert "signal: monitor (fall from its best)" in table
    rollout_rescore.main(["--tracking-uri", uri, "--monitor", reward_path, "--out", str(tmp_path / "u.csv")])
    printed = capsys.readouterr().out
    assert "2 runs with recorded rollouts: 1 whose gold falls, 1 not" in printed and "monitor" in printed
    assert len(pd.read_csv(tmp_path / "u.csv")) == 6
