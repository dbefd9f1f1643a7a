"""Metrics written to MLflow in batches of steps: nothing dropped, each step with its own time, all steps up to a
saved resume state written before the state, the rest when the run ends."""

from __future__ import annotations

import pandas as pd
import pytest

from rlhf.config import RuntimeConfig, SFTConfig
from rlhf.data import synthetic
from rlhf.errors import TrainingInterrupted
from rlhf.logs import BatchedLog, flush_log
from rlhf.sft import bootstrap_sft
from rlhf.tracking import Tracker


def test_batched_log_writes_the_first_step_then_batches_and_the_rest_on_flush():
    written: list[list[tuple]] = []
    seen: list[int] = []
    log = BatchedLog(written.append, every_s=3600, also=lambda metrics, step: seen.append(step))
    for step in range(1, 5):
        log({"loss": float(step)}, step)
    assert [[s for _, s, _ in batch] for batch in written] == [[1]]  # the first at once, the others held
    assert seen == [1, 2, 3, 4]  # `also` sees every step as it comes
    flush_log(log)
    assert [[s for _, s, _ in batch] for batch in written] == [[1], [2, 3, 4]]
    times = [at for batch in written for _, _, at in batch]
    assert times == sorted(times)
    flush_log(log)  # nothing left: no empty write
    flush_log(lambda metrics, step: None)  # a plain function: nothing to flush
    assert len(written) == 2

    every = BatchedLog(written.append, every_s=0.0)  # no wait: every step written as it comes
    every({"loss": 1.0}, 1)
    every({"loss": 2.0}, 2)
    assert len(written) == 4


def _history(tracker: Tracker, run_id: str, key: str) -> list[tuple[int, float, int]]:
    return sorted((m.step, m.value, m.timestamp) for m in tracker.client.get_metric_history(run_id, key))


def test_tracker_batches_steps_and_end_run_writes_the_rest(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "batches", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("ppo")
    log = tracker.metric_logger(run_id, every_s=3600)
    for step in range(1, 6):
        log({"objective/kl": 0.1 * step, "objective/scores": float(step)}, step)
    assert [s for s, _, _ in _history(tracker, run_id, "objective/kl")] == [1]
    tracker.end_run(run_id)
    history = _history(tracker, run_id, "objective/kl")
    assert [s for s, _, _ in history] == [1, 2, 3, 4, 5]
    assert [v for _, v, _ in history] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert [t for _, _, t in history] == sorted(t for _, _, t in history)  # each step keeps its own time
    assert len(_history(tracker, run_id, "objective/scores")) == 5
    assert tracker.get_run(run_id).info.status == "FINISHED"


def test_a_trainer_writes_the_held_steps_before_it_saves_a_resume_state(tmp_path):
    demos, pairs = tmp_path / "sft.parquet", tmp_path / "train.parquet"
    pd.DataFrame([{"prompt": d.prompt, "response": d.response} for d in synthetic.demonstrations(32, 0)]).to_parquet(
        demos
    )
    rows = synthetic.preference_pairs(16, seed=0, label_noise=0.0, split="train")
    pd.DataFrame([p._asdict() for p in rows]).to_parquet(pairs)
    cfg = SFTConfig.model_validate(
        {"steps": 30, "batch_size": 4, "save_every": 20, "bootstrap": {"n_layer": 1, "n_embd": 32, "vocab_size": 320}}
    )
    written: list[int] = []
    log = BatchedLog(lambda steps: written.extend(step for _, step, _ in steps), every_s=3600)
    runtime = RuntimeConfig(device="cpu", progress=False)
    with pytest.raises(TrainingInterrupted):  # stopped after 20 steps, as a crash would, its state saved
        bootstrap_sft(cfg, runtime, demos, pairs, tmp_path / "sft", 0, log, stop_after=20)
    assert written == [0, 10]  # SFT logs every 10th step: step 10 was held until the state was saved
