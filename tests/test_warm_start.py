"""The verified best-of-N warm start (rlhf/train/warm_start.py, the stage `warm_start_policy`): the real flow on a
tiny Llama-style model with a chat template and a verifiable task whose rows carry their own truth (a row column),
a real Prefect test harness and a SQLite MLflow store. It keeps only what the verifier passes and fine-tunes on it,
the policy stage starts from it while the evaluation compares against the SFT policy, it is logged, cached, retried
from its written samples and saved state, and its two bad inputs are one sentence each (exit code 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from flows.pipeline import rlhf_pipeline
from flows.pipeline_command import main as pipeline_command
from flows.summary import format_summary
from flows.terminal import exit_code_of
from rlhf import metrics as declared
from rlhf.config import load_config
from rlhf.errors import ConfigError
from rlhf.eval import evaluate
from rlhf.memory import estimate, shape_of
from rlhf.models.model_config import read_model_config
from rlhf.preflight import check_lengths
from rlhf.stages import stages_of
from rlhf.train import warm_start
from tests.conftest import REPO, flow_run_artifacts, task_runs, task_states

# one Prefect test harness for the module's flow runs (one xdist worker runs them)
pytestmark = pytest.mark.xdist_group("warm_start")
PROMPTS, SAMPLES = 6, 4  # warm_start.prompts and warm_start.samples of the runs below
SCORED: list[tuple[str, int]] = []  # (prompt, item) of every response `item_parity` scored


def item_parity(prompts, completions, item):
    """1 where a response's length in characters has the parity of its row's `item`, else 0: about half of a random
    model's responses pass. Fails the run if a response gets another row's value."""
    for prompt, number in zip(prompts, item, strict=True):
        assert f"Item {number}:" in prompt, (prompt, number)
        SCORED.append((prompt, number))
    return [float((len(c) + n) % 2 == 0) for c, n in zip(completions, item, strict=True)]


def never(prompts, completions):
    """A verifier nothing passes."""
    return [0.0] * len(completions)


def _rows(n: int, start: int = 0) -> list[dict]:
    return [
        {"prompt": f"Item {i}: tell me about bees.", "chosen": "Bees hum.", "rejected": "Bees, yes.", "item": i}
        for i in range(start, start + n)
    ]


def _config(tmp_path: Path, model: Path, function: str = "item_parity", *extra: str):
    for name, rows in (("train", _rows(24)), ("eval", _rows(8, start=100))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(
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
            f"sft.model={model}",  # used as it is: the SFT stage trains nothing
            "reward.source=function",
            f"reward.function={__name__}:{function}",
            "warm_start.enabled=true",
            f"warm_start.samples={SAMPLES}",
            f"warm_start.prompts={PROMPTS}",
            "warm_start.max_new_tokens=8",
            "warm_start.steps=4",
            "warm_start.batch_size=4",
            "warm_start.lr=1e-3",
            "ppo.total_episodes=8",
            "ppo.batch_size=8",
            "ppo.num_mini_batches=1",
            "ppo.num_ppo_epochs=1",
            "ppo.max_new_tokens=6",
            "eval.n_prompts=4",
            "eval.batch_size=4",
            *extra,
        ],
    )


@pytest.fixture
def counted_sampling(monkeypatch) -> list[int]:
    """How many times the warm start sampled (one entry per call of `sample_candidates`)."""
    calls: list[int] = []
    sample = warm_start.sample_candidates

    def counted(*args, **kwargs):
        calls.append(1)
        return sample(*args, **kwargs)

    monkeypatch.setattr(warm_start, "sample_candidates", counted)
    return calls


def test_select_keeps_distinct_passing_responses_best_first():
    # prompt a: 'x' 0.5, 'y' 1.0 twice (the same text), 'z' 0.2; prompt b: 'u' 0.9, 'v' 0.1
    frame = pd.DataFrame(
        {
            "prompt": ["a", "a", "a", "a", "b", "b"],
            "row": ["a", "a", "a", "a", "b", "b"],
            "response": ["x", "y", "y", "z", "u", "v"],
            "score": [0.5, 1.0, 1.0, 0.2, 0.9, 0.1],
        }
    )
    # min_score 0.5, 2 a prompt: a's 1.0 'y' (its second 'y' is the same text) then 0.5 'x'; b's 0.9 'u'
    assert warm_start.select(frame, 0.5, 2).tolist() == [True, True, False, False, True, False]
    # min_score 1.0, 1 a prompt: a's first 'y' only; nothing of b passes
    assert warm_start.select(frame, 1.0, 1).tolist() == [False, True, False, False, False, False]
    assert not warm_start.select(frame, 2.0, 3).any()


def test_the_stage_is_declared_only_where_it_is_on():
    assert [s.short for s in stages_of("ppo", "function", warm_start=True)] == [
        "data",
        "sft",
        "warm",
        "init",
        "ppo",
        "eval",
    ]
    assert [s.short for s in stages_of("dpo", "model", warm_start=True)] == [
        "data",
        "sft",
        "warm",
        "reward",
        "dpo",
        "eval",
    ]
    assert "warm" not in [s.short for s in stages_of("ppo", "function")]


def test_warm_start_keeps_what_the_verifier_passes_is_logged_retried_and_cached(
    harness, tmp_path, monkeypatch, family_checkpoint, counted_sampling
):
    model = family_checkpoint("llama")
    cfg = _config(tmp_path, model)
    evaluated: list[str] = []  # the SFT checkpoint the evaluation compares against
    evaluate_policies = evaluate.evaluate_policies

    def recording(*args, **kwargs):
        evaluated.append(args[4])  # sft_path
        return evaluate_policies(*args, **kwargs)

    monkeypatch.setattr(evaluate, "evaluate_policies", recording)
    # the first attempt stops after 2 of its 4 steps, as a crash would; Prefect retries it
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "warm_start_policy:2")
    SCORED.clear()
    first = rlhf_pipeline(cfg, return_state=True)
    summary = first.result()

    # the samples: written once (the retry read them), every prompt's own row column reached the verifier
    assert len(counted_sampling) == 1
    stage_folder = Path(summary["warm_start_checkpoint"]).parent
    samples = pd.read_parquet(stage_folder / warm_start.SAMPLES_FILE)
    assert list(samples.columns) == list(warm_start.COLUMNS) and len(samples) == PROMPTS * SAMPLES
    # stopped: ended with a stop token; a response at the token limit without one was cut (and learns no EOS)
    limit = cfg.warm_start.max_new_tokens or cfg.ppo.max_new_tokens
    assert not samples.loc[samples["tokens"] < limit, "stopped"].eq(False).any()
    assert samples["stopped"].dtype == bool
    # the verifier's first calls (then PPO's and the evaluation's): the warm start's samples, each with its own row
    assert [prompt for prompt, _ in SCORED[: len(samples)]] == samples["prompt"].tolist()
    kept = samples[samples["kept"]]
    assert 0 < len(kept) < len(samples), "the planted verifier passes some responses, not all"
    assert (kept["score"] >= cfg.warm_start.min_score).all()
    # one kept (warm_start.keep_per_prompt) for every prompt with a passing response
    assert kept["prompt"].is_unique
    assert set(kept["prompt"]) == set(samples.loc[samples["score"] >= cfg.warm_start.min_score, "prompt"])

    # fine-tuned on them: the checkpoint's weights moved from the SFT model's
    sft = load_file(Path(summary["sft_checkpoint"]) / "model.safetensors")
    warm = load_file(Path(summary["warm_start_checkpoint"]) / "model.safetensors")
    assert sft.keys() == warm.keys()
    assert any(not torch.equal(sft[k], warm[k]) for k in sft)

    # the policy and its reference start from it; the evaluation compares against the original SFT policy
    client = MlflowClient(cfg.tracking.uri)
    runs = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    by_stage = {}
    for run in runs:
        by_stage.setdefault(run.data.tags.get("stage"), []).append(run)
    init = by_stage["init_policy_models"][0].data.params
    assert init["policy_init"] == init["reference_init"] == summary["warm_start_checkpoint"]
    assert evaluated == [summary["sft_checkpoint"]]

    # logged: one stage run (the retry continued it), its params, metrics, kept table and checkpoint
    (run,) = by_stage["warm_start_policy"]
    assert run.info.run_name.endswith("/warm")
    assert run.data.params["warm_start.samples"] == str(SAMPLES)
    assert run.data.params["reward.functions"] == f"{__name__}:item_parity"
    assert run.data.params["reward.weights"] == "[1.0]"
    metrics = run.data.metrics
    assert metrics[declared.WARM_START_PROMPTS] == PROMPTS and metrics[declared.WARM_START_SAMPLES] == PROMPTS * SAMPLES
    assert metrics[declared.WARM_START_KEPT] == len(kept)
    assert metrics[declared.WARM_START_KEPT_FRACTION] == pytest.approx(len(kept) / len(samples))
    assert metrics[declared.WARM_START_PROMPTS_KEPT] == kept["prompt"].nunique()
    assert metrics[declared.WARM_START_MEAN_SCORE] == pytest.approx(samples["score"].mean())
    assert metrics[declared.WARM_START_RESPONSE_TOKENS] == pytest.approx(samples["tokens"].mean())
    assert metrics[declared.WARM_START_KEPT_RESPONSE_TOKENS] == pytest.approx(kept["tokens"].mean())
    assert metrics[declared.WARM_START_SAMPLING_TIME] > 0 and metrics["time/sft"] > 0
    # the loss curve: step 1 by the first attempt, then the last step by the retry, which resumed at step 2
    assert [m.step for m in client.get_metric_history(run.info.run_id, "sft/loss")] == [1, 4]
    assert {"warm_start", "warm_start_checkpoint"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "warm_start_checkpoint/model.safetensors" in {
        a.path for a in client.list_artifacts(run.info.run_id, "warm_start_checkpoint")
    }
    table = Path(client.download_artifacts(run.info.run_id, "warm_start/kept.json", str(tmp_path / "table")))
    assert len(json.loads(table.read_text())["data"]) == len(kept)  # the kept samples, as an MLflow table
    # the pipeline run names it: the summary, the evaluation table's stages, the pipeline run's figures
    assert "warm start checkpoint" in format_summary(summary)
    (evaluation,) = [a for a in flow_run_artifacts(first.state_details.flow_run_id) if a.key == "rlhf-evaluation"]
    assert "| warm start | ran |" in evaluation.data
    assert summary[declared.WARM_START_KEPT_FRACTION] == pytest.approx(len(kept) / len(samples))

    # cached: the same config again runs nothing, samples nothing, opens no second warm-start run
    again = rlhf_pipeline(cfg, return_state=True)
    assert again.result()["warm_start_checkpoint"] == summary["warm_start_checkpoint"]
    assert task_states(again.state_details.flow_run_id)["warm_start_policy"] == "Cached"
    assert len(counted_sampling) == 1
    runs = client.search_runs([run.info.experiment_id], "tags.stage = 'warm_start_policy'")
    assert len(runs) == 1


def test_a_warm_start_that_keeps_nothing_is_one_sentence_and_stops_the_run(
    harness, tmp_path, family_checkpoint, counted_sampling, capsys
):
    cfg = _config(tmp_path, family_checkpoint("llama"), "never")
    state = rlhf_pipeline(cfg, return_state=True)
    code, summary = exit_code_of(state.result)  # what the command prints and returns
    assert (code, summary) == (2, None)
    sentence = (
        f"warm start kept no response: 0 of {PROMPTS * SAMPLES} samples of {PROMPTS} prompts scored at least 1.0 "
        "(warm_start.min_score); raise warm_start.samples or lower warm_start.min_score"
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {sentence}"]
    # not retried, nothing after it ran, its samples written
    flow_run = state.state_details.flow_run_id
    states = task_states(flow_run)
    assert states["warm_start_policy"] == "Failed"
    assert not {"init_policy_models", "train_policy_ppo", "evaluate_policies"} & set(states)
    (warm_run,) = [t for t in task_runs(flow_run) if t.name.startswith("warm_start_policy")]
    assert warm_run.run_count == 1
    (folder,) = (tmp_path / "out" / "warm_start_policy").glob("warm_start_policy-*/")
    assert len(pd.read_parquet(folder / warm_start.SAMPLES_FILE)) == PROMPTS * SAMPLES
    assert len(counted_sampling) == 1
    # a rerun reads them (no sampling) and says the same
    code, _ = exit_code_of(rlhf_pipeline(cfg, return_state=True).result)
    assert code == 2 and len(counted_sampling) == 1
    assert f"error: {sentence}" in capsys.readouterr().err


def test_a_warm_start_longer_than_the_models_positions_is_refused_and_its_memory_estimated():
    cfg = load_config(
        REPO / "conf" / "smoke.yaml",
        ["reward.source=function", f"reward.function={__name__}:never", "warm_start.enabled=true"],
    )
    model_config = read_model_config(cfg.sft)
    check_lengths(cfg, model_config)  # ppo.max_new_tokens: 64 + 12 of the 128 positions
    assert "warm_start" in [e.stage for e in estimate(cfg, shape_of(model_config), "cpu")]
    cfg.warm_start.max_new_tokens = 100
    with pytest.raises(ConfigError) as err:
        check_lengths(cfg, model_config)
    assert str(err.value).startswith(
        "ppo.max_prompt_tokens + warm_start.max_new_tokens (64 + 100) exceeds the 128 positions of the SFT model"
    )
    cfg.warm_start.enabled = False
    check_lengths(cfg, model_config)
    assert "warm_start" not in [e.stage for e in estimate(cfg, shape_of(model_config), "cpu")]


def test_a_warm_start_without_a_verifier_is_refused_before_anything_runs(tmp_path, capsys):
    args = ["--config", str(REPO / "conf" / "smoke.yaml"), "warm_start.enabled=true"]
    args += [f"runtime.output_dir={tmp_path}/out", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    assert pipeline_command(args) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"error: {REPO / 'conf' / 'smoke.yaml'}: warm_start.enabled needs reward.function to keep the sampled "
        "responses by (reward.source is 'model' with no function): name a verifier, e.g. "
        "reward.function=rlhf.data.verifiers:ifeval_strict, or set warm_start.enabled: false"
    ]
    assert "Traceback" not in err and not (tmp_path / "out").exists()
