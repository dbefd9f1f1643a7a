"""A bad config or bad data reads the same on the terminal whether preflight or a task inside the flow finds it:
one sentence, exit code 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, seed_prefect_home

from rlhf.errors import CheckpointWriteError, DataError, NonFiniteError


def run_pipeline(tmp_path, *overrides: str, prefect_api: str | None = None) -> subprocess.CompletedProcess:
    """`python -m flows.pipeline` on conf/smoke.yaml; against the worker's shared Prefect server when given one (a
    run that gets to its flow), else with its own temporary server."""
    env = {**os.environ, "PREFECT_HOME": seed_prefect_home(tmp_path / "prefect"), "PYTHONUNBUFFERED": "1"}
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    args = [sys.executable, "-m", "flows.pipeline", "--config", "conf/smoke.yaml"]
    args += [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"runtime.output_dir={tmp_path}/out", *overrides]
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def assert_one_sentence(proc: subprocess.CompletedProcess, *words: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    for word in words:
        assert word in errors[0], errors[0]
    for name in ("DataError", "ConfigError"):
        assert name not in output, output


def test_lengths_past_the_models_positions_are_refused_before_the_flow(tmp_path):
    # the HH example's lengths against the 128 positions of the bootstrap model
    proc = run_pipeline(tmp_path, "reward.max_length=512", "ppo.max_prompt_tokens=256", "ppo.max_new_tokens=64")
    assert_one_sentence(proc, "reward.max_length", "ppo.max_prompt_tokens + ppo.max_new_tokens", "128 positions")
    assert "Beginning flow run" not in proc.stdout + proc.stderr


def test_a_file_without_preference_pairs_is_refused_from_its_first_rows(tmp_path):
    # HH's red-team-attempts layout: transcripts and ratings, no pairs; seen from the first rows, before the flow
    path = tmp_path / "red_team_attempts.jsonl"
    rows = [
        {"transcript": "\n\nHuman: hi\n\nAssistant: hello", "rating": i % 4, "task_description": "x"} for i in range(20)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    proc = run_pipeline(tmp_path, "data.source=local", f"data.path={path}")
    assert_one_sentence(proc, str(path), "no recognisable preference format")
    assert "Beginning flow run" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_bad_data_found_inside_the_flow_is_one_sentence(tmp_path, shared_prefect_api):
    # HH layout, but every pair's two answers are the same: only the full validation inside the task sees it
    path = tmp_path / "pairs.jsonl"
    text = "\n\nHuman: Review of The Silent River:\n\nAssistant: the plot was superb."
    path.write_text("\n".join(json.dumps({"chosen": text, "rejected": text}) for _ in range(40)) + "\n")
    proc = run_pipeline(tmp_path, "data.source=local", f"data.path={path}", prefect_api=shared_prefect_api)
    assert "Beginning flow run" in proc.stdout + proc.stderr
    assert_one_sentence(proc, str(path))


# -- Anticipated failures during a run: one sentence, an exit code of their own ------------------------------------

TRACKING_GONE = (
    "API request to http://127.0.0.1:5055/api/2.0/mlflow/runs/log-batch failed with exception "
    "HTTPConnectionPool(host='127.0.0.1', port=5055): Max retries exceeded with url: /api/2.0/mlflow/runs/log-batch "
    '(Caused by NewConnectionError("Failed to establish a new connection: [Errno 111] Connection refused"))'
)


def _raised(err: BaseException, cause: BaseException | None = None) -> BaseException:
    """`err` as it arrives: raised, with `cause` as its cause (a Prefect task's failure wraps the stage's error)."""
    try:
        try:
            if cause is not None:
                raise cause
        except BaseException as inner:
            raise err from inner
        raise err
    except BaseException as caught:  # noqa: BLE001
        return caught


@pytest.mark.parametrize(
    ("err", "code", "words"),
    [
        (NonFiniteError("reward model stopped at step 2: train/loss is nan (non-finite); ..."), 3, "step 2"),
        (
            CheckpointWriteError("no space left on the device while writing /o/x; the previous checkpoint is intact"),
            4,
            "free space on that disk",
        ),
        (
            _raised(RuntimeError("task failed"), RuntimeError(TRACKING_GONE)),
            5,
            "http://127.0.0.1:5055 stopped answering",
        ),
        (_raised(RuntimeError("task failed"), DataError("x.jsonl: no rows")), 2, "x.jsonl: no rows"),
    ],
    ids=["non-finite", "disk-full", "tracking-gone", "user-error"],
)
def test_an_anticipated_failure_is_one_sentence_with_its_own_exit_code(err, code, words, capsys):
    from flows.terminal import anticipated_failure, exit_code_of

    assert anticipated_failure(err).code == code

    def run():
        raise err

    assert exit_code_of(run) == (code, None)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines


def test_anything_else_keeps_its_traceback():
    from flows.terminal import anticipated_failure, exit_code_of

    assert anticipated_failure(RuntimeError("CUDA error: device-side assert triggered")) is None
    with pytest.raises(ZeroDivisionError):
        exit_code_of(lambda: 1 / 0)


def test_the_console_drops_the_records_of_an_anticipated_failure():
    import logging

    from flows.terminal import HideUserErrorRecords

    def record(msg: str, exc: BaseException | None = None) -> logging.LogRecord:
        info = (type(exc), exc, None) if exc else None
        return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, msg, None, info)

    hide = HideUserErrorRecords()
    assert not hide.filter(record("Task run failed with exception", NonFiniteError("SFT stopped at step 3")))
    assert not hide.filter(record("Finished in state Failed('Task run encountered an exception NonFiniteError: x')"))
    assert not hide.filter(record(f"Finished in state Failed('MlflowException: {TRACKING_GONE}')"))
    assert hide.filter(record("Finished in state Failed('RuntimeError: CUDA error')"))


def test_ctrl_c_in_a_served_run_is_one_sentence_and_a_keyboard_interrupt(monkeypatch, capsys):
    """A deployment's flow run (make ui): SIGINT prints one sentence, silences the console and unwinds as Ctrl-C
    (a KeyboardInterrupt, which ends the stages' MLflow runs KILLED); outside a deployment's run nothing changes."""
    import logging
    import signal

    from flows.terminal import quiet_stop_in_served_run

    before = signal.getsignal(signal.SIGINT)
    quiet_stop_in_served_run()  # no deployment: the CLI's own handling stays
    assert signal.getsignal(signal.SIGINT) is before
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "d")
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__NAME", "green-beluga")
    console = logging.StreamHandler()
    logging.getLogger("prefect").addHandler(console)
    try:
        quiet_stop_in_served_run()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        record = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "Crash detected!", None, None)
        assert not console.filter(record)  # the traceback Prefect logs next stays off the console
    finally:
        signal.signal(signal.SIGINT, before)
        logging.getLogger("prefect").removeHandler(console)
        for handler in logging.getLogger().handlers + logging.getLogger("prefect").handlers:
            handler.filters = [f for f in handler.filters if type(f).__name__ != "_QuietAfterStop"]
    (sentence,) = capsys.readouterr().err.splitlines()
    assert sentence.startswith("flow run 'green-beluga' stopped by Ctrl-C (SIGINT)") and "KILLED" in sentence


def test_a_prefect_server_that_does_not_answer_is_one_sentence_before_the_flow(capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.terminal import exit_code_of
    from tests.conftest import free_port

    ran = []
    url = f"http://127.0.0.1:{free_port()}/api"
    with temporary_settings(updates={PREFECT_API_URL: url}):
        assert exit_code_of(lambda: ran.append(1)) == (2, None)
    assert not ran
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: PREFECT_API_URL is {url}, but no Prefect server answers there"), line


@pytest.mark.slow
def test_a_non_finite_loss_mid_run_is_one_sentence_and_every_record_is_complete(tmp_path):
    """`reward.lr=1e30`: the reward model's loss is NaN at its second step. The run ends in one sentence with exit
    code 3 (not 2: the config is valid), the reward stage's Prefect task run Failed with the same sentence as its
    message, its MLflow run and the pipeline's FAILED, and the SFT stage's output kept for the rerun."""
    import sqlite3

    from mlflow.tracking import MlflowClient

    proc = run_pipeline(tmp_path, "reward.lr=1e30", "reward.warmup_ratio=0")  # its Prefect database: read below
    output = proc.stdout + proc.stderr
    assert proc.returncode == 3, output
    assert "Traceback" not in output, output
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    sentence = line.removeprefix("error: ")
    assert sentence.startswith("reward model stopped at step ") and "the last saved state is kept" in sentence
    assert "runtime.on_nonfinite" in sentence

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    status = {r.info.run_name.rsplit("/", 1)[-1]: r.info.status for r in client.search_runs([experiment.experiment_id])}
    assert status.pop("reward") == "FAILED" and status.pop("sft") == "FINISHED", status
    assert "RUNNING" not in status.values() and "FAILED" in status.values(), status  # the pipeline run
    assert list((tmp_path / "out" / "supervised_finetune").glob("*/manifest.json")), "the SFT stage is kept"

    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        rows = db.execute(
            "SELECT task_run.name, task_run_state.name, task_run_state.message FROM task_run "
            "JOIN task_run_state ON task_run.state_id = task_run_state.id"
        ).fetchall()
    (reward,) = [(state, message) for name, state, message in rows if name.startswith("train_reward_model")]
    assert reward[0] == "Failed" and sentence in reward[1], reward
