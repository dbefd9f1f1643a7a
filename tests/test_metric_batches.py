"""Metrics written to MLflow in batches of steps: nothing dropped, each step with its own time, all steps up to a
saved resume state written before the state, the rest when the run ends."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from rlhf.config import RuntimeConfig, SFTConfig
from rlhf.data import synthetic
from rlhf.errors import TrainingInterrupted
from rlhf.tracking.client import Tracker
from rlhf.tracking.metrics_writer import BatchedLog, flush_log
from rlhf.train.sft import bootstrap_sft

REPO = Path(__file__).resolve().parent.parent


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
        {
            "steps": 30,
            "warmup_ratio": 1.0,
            "batch_size": 4,
            "save_every": 20,
            "bootstrap": {"n_layer": 1, "n_embd": 32, "vocab_size": 320},
        }
    )
    written: list[int] = []
    log = BatchedLog(lambda steps: written.extend(step for _, step, _ in steps), every_s=3600)
    runtime = RuntimeConfig(device="cpu", progress=False)
    with pytest.raises(TrainingInterrupted):  # stopped after 20 steps, as a crash would, its state saved
        bootstrap_sft(cfg, runtime, demos, pairs, tmp_path / "sft", 0, log, stop_after=20)
    assert written == [1, 10, 20]  # SFT logs its first and every 10th step: 10 and 20 held until the state was saved


# -- a writer thread of its own (background=True): the training loop only queues its steps --------------------------


def test_background_log_writes_in_its_own_thread_every_step_in_order_with_its_own_time():
    written: list[tuple[str, list[tuple]]] = []
    log = BatchedLog(lambda steps: written.append((threading.current_thread().name, steps)), 3600, background=True)
    before = time.time()
    for step in range(1, 6):
        log({"loss": float(step), "nan": float("nan"), "inf": float("inf")}, step)
    time.sleep(0.05)  # the writer wrote the first step at once, and holds the others for an hour
    log.close()
    assert [name for name, _ in written] == ["metrics-writer", "MainThread"]  # the rest written by close()
    steps = [record for _, batch in written for record in batch]
    assert [s for _, s, _ in steps] == [1, 2, 3, 4, 5]
    assert all(math.isnan(m["nan"]) and m["inf"] == math.inf for m, _, _ in steps)  # NaN and inf kept as they are
    times = [at for _, _, at in steps]
    assert before <= times[0] and times == sorted(times) and times[-1] <= time.time()
    assert not log._thread  # close() stopped the writer


def test_a_failed_background_write_keeps_its_steps_and_reaches_the_training_thread():
    written: list[int] = []
    failures = [RuntimeError("database is locked"), RuntimeError("database is locked")]

    def write(steps):
        if failures:
            raise failures.pop(0)
        written.extend(step for _, step, _ in steps)

    log = BatchedLog(write, 3600, background=True)
    log({"loss": 1.0}, 1)  # the writer's first write fails: the writer stops, the step is kept
    log._thread.join(5)
    assert log.error is not None and written == []
    with pytest.raises(RuntimeError, match="database is locked"):  # the caller's retry fails too: raised
        log({"loss": 2.0}, 2)
    assert [s for _, s, _ in log.pending] == [1]  # nothing lost, and the raising step was not taken
    log({"loss": 2.0}, 2)  # the store works again: the kept step is written, then the new one by a new writer
    log.close()
    assert written == [1, 2]

    flaky = BatchedLog(write, 3600)
    failures.append(RuntimeError("disk full"))
    with pytest.raises(RuntimeError, match="disk full"):  # a write of the caller's own thread raises at once
        flaky({"loss": 3.0}, 3)
    flaky.flush()
    assert written == [1, 2, 3]


def test_flush_waits_for_the_writer_and_leaves_nothing_behind():
    started, release = threading.Event(), threading.Event()
    written: list[int] = []

    def slow_write(steps):
        started.set()
        release.wait(5)
        written.extend(step for _, step, _ in steps)

    log = BatchedLog(slow_write, 3600, background=True)
    log({"loss": 1.0}, 1)
    assert started.wait(5)  # the writer is inside its write of step 1
    log({"loss": 2.0}, 2)
    threading.Timer(0.1, release.set).start()
    flush_log(log)  # as before a resume state: waits for the writer's write, then writes step 2
    assert written == [1, 2]
    log.close()


def test_background_loggers_still_open_are_flushed_when_the_process_exits(tmp_path):
    out = tmp_path / "steps.txt"
    script = f"""
from rlhf.tracking.metrics_writer import BatchedLog
out = open({str(out)!r}, "a")
def write(steps):
    out.write("".join(f"{{step}}\\n" for _, step, _ in steps)); out.flush()
log = BatchedLog(write, 3600, background=True)
for step in range(1, 8):
    log({{"loss": float(step)}}, step)
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO, timeout=60)
    assert out.read_text().split() == [str(step) for step in range(1, 8)]


def test_tracker_background_writer_loses_nothing_across_a_resume_and_at_run_end(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "background", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("ppo")
    log = tracker.metric_logger(run_id, every_s=3600, background=True)
    for step in range(1, 5):
        log({"objective/kl": 0.1 * step, "policy/loss": float("nan") if step == 2 else 1.0}, step)
    flush_log(log)  # a resume state saved after step 4; then the process dies before step 6 is written
    log({"objective/kl": 0.5, "policy/loss": 1.0}, 5)
    log.close()
    assert [s for s, _, _ in _history(tracker, run_id, "objective/kl")] == [1, 2, 3, 4, 5]

    resumed = Tracker(uri, "background", str(tmp_path / "artifacts"))  # the retry, in a new process
    resumed.reopen_run(run_id)
    log = resumed.metric_logger(run_id, every_s=3600, background=True)
    before = time.time()
    for step in range(5, 9):  # from the state of step 4: step 5 again (not logged twice), then new steps
        log({"objective/kl": 0.1 * step, "policy/loss": float("inf")}, step)
    resumed.end_run(run_id)
    history = _history(resumed, run_id, "objective/kl")
    assert [s for s, _, _ in history] == list(range(1, 9))
    assert [v for _, v, _ in history] == pytest.approx([0.1 * s for s in range(1, 9)])
    assert all(before * 1000 - 1 <= t for s, _, t in history if s >= 6)  # their own logging times
    losses = dict((s, v) for s, v, _ in _history(resumed, run_id, "policy/loss"))
    assert math.isnan(losses[2]) and losses[7] >= 1.7e308  # NaN and inf reached the store
    assert resumed.get_run(run_id).info.status == "FINISHED"


def test_tracker_background_writer_is_flushed_when_the_stage_fails(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "background", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("sft")
    log = tracker.metric_logger(run_id, every_s=3600, background=True)
    with pytest.raises(ZeroDivisionError):
        try:
            for step in range(1, 4):
                log({"sft/loss": float("nan") if step == 3 else 1.0 / step}, step)
            _ = 1 / 0  # the training loop fails
        except BaseException:
            tracker.end_run(run_id, failed=True)  # as `stage_run` does
            raise
    assert [s for s, _, _ in _history(tracker, run_id, "sft/loss")] == [1, 2, 3]
    assert math.isnan(_history(tracker, run_id, "sft/loss")[-1][1])
    assert tracker.get_run(run_id).info.status == "FAILED"


def test_a_run_whose_steps_cannot_be_written_ends_failed_and_says_so(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "background", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("ppo")
    log = tracker.metric_logger(run_id, every_s=3600, background=True)
    log({"objective/kl": 0.1}, 1)
    log._thread.join(5)
    log({"objective/kl": "not a number"}, 2)  # type: ignore[dict-item]  (a write that can never succeed)
    with pytest.raises(ValueError):
        tracker.end_run(run_id)
    assert tracker.get_run(run_id).info.status == "FAILED"
    assert [s for s, _, _ in _history(tracker, run_id, "objective/kl")] == [1]
