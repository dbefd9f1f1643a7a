"""Process-level faults, with real processes: the pipeline killed with SIGKILL (once, or again and again) and then
run again with the same command, and two pipelines started together on one output folder and MLflow store."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, seed_prefect_home
from mlflow.tracking import MlflowClient

STAGES = (
    "prepare_preferences",
    "supervised_finetune",
    "train_reward_model",
    "init_policy_models",
    "train_policy_ppo",
    "evaluate_policies",
)
# one xdist worker runs the whole module: the two runs at once are every test's reference (a module fixture)
pytestmark = pytest.mark.xdist_group("process_faults")
RESULT_METRICS = ("eval/win_rate_gold", "eval/win_rate_rm", "eval/kl", "eval/policy_gold", "reward/best_eval_accuracy")


def start(
    root: Path, name: str = "run", extra: tuple[str, ...] = (), new_database: bool = False
) -> tuple[subprocess.Popen, Path]:
    """`python -m flows.pipeline --config conf/smoke.yaml` on the store and output folder under `root`, saving every
    step, in a session of its own (its process group holds its temporary Prefect server too); output to a file."""
    home = root / "prefect"
    if not new_database and not home.exists():
        seed_prefect_home(home)  # a migrated database, as on a machine that ran the pipeline before
    env = {**os.environ, "PREFECT_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "flows.pipeline", "--config", "conf/smoke.yaml"]
    args += [f"tracking.uri=sqlite:///{root}/mlflow.db", f"tracking.artifact_location={root}/artifacts"]
    args += [f"runtime.output_dir={root}/out"]
    args += ["ppo.save_every=1", "reward.save_every=1", *extra]
    log = root / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    """Wait for a run; its output, asserted free of errors."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    output = log.read_text()
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output
    return output


def kill_when(proc: subprocess.Popen, ready, timeout: float = 240, stop: bool = True) -> None:
    """SIGKILL the run's whole process group as soon as `ready()` holds (with `stop` false: only wait for it)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "the moment to kill never came"
        time.sleep(0.02)
    if stop:
        kill(proc)


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def saved_state(root: Path, stage: str) -> bool:
    return any((root / "out" / stage).glob("*/state/trainer_state.pt"))


def completed(root: Path, stage: str) -> bool:
    """The stage's output is complete: its manifest (the reward model's folder, PPO's final policy) is written."""
    return any((root / "out" / stage).glob("*/manifest.json")) or any(
        (root / "out" / stage).glob("*/final/manifest.json")
    )


def runs(root: Path) -> list:
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    return client.search_runs([experiment.experiment_id], max_results=1000)


def stage_runs(root: Path, stage: str) -> list:
    return [r for r in runs(root) if r.data.tags.get("stage") == stage]


def pipeline_runs(root: Path) -> list:
    return [r for r in runs(root) if "stage" not in r.data.tags]


def steps(root: Path, run, key: str) -> list[int]:
    return sorted(m.step for m in MlflowClient(f"sqlite:///{root}/mlflow.db").get_metric_history(run.info.run_id, key))


def result(root: Path) -> dict:
    """The finished pipeline run's figures and the final policy's content digest."""
    finished = max((r for r in pipeline_runs(root) if r.info.status == "FINISHED"), key=lambda r: r.info.start_time)
    (manifest,) = (root / "out" / "train_policy_ppo").glob("*/final/manifest.json")
    figures = {k: finished.data.metrics[k] for k in RESULT_METRICS}
    return {**figures, "digest": json.loads(manifest.read_text())["digest"]}


def cached(output: str) -> set[str]:
    """The stages whose Prefect task run finished in state Cached."""
    return {s for s in STAGES if f"Task run '{s}-" in output and _finished_cached(output, s)}


def _finished_cached(output: str, stage: str) -> bool:
    return any(f"Task run '{stage}-" in line and "Finished in state Cached" in line for line in output.splitlines())


def assert_clean_store(root: Path, finished_runs: int = 1) -> None:
    """No run left RUNNING; one finished run per stage; the killed attempts' pipeline runs marked KILLED (and
    `finished_runs` pipeline runs finished)."""
    statuses = Counter(r.info.status for r in runs(root))
    assert statuses["RUNNING"] == 0, statuses
    for stage in STAGES:
        assert [r.info.status for r in stage_runs(root, stage)].count("FINISHED") == 1, stage
    parents = Counter(r.info.status for r in pipeline_runs(root))
    assert parents["FINISHED"] == finished_runs and set(parents) <= {"FINISHED", "KILLED"}, parents


@pytest.fixture(scope="module")
def two_runs_at_once(tmp_path_factory) -> tuple[Path, list[str]]:
    """Two pipelines started together on one output folder, MLflow store and Prefect home, both finished: (their
    folder, their outputs). Neither is interrupted, so their figures are also the reference the killed and rerun
    pipelines are compared with (one run serves both, instead of another uninterrupted run)."""
    root = tmp_path_factory.mktemp("two-at-once")
    first = start(root, name="first", new_database=True)  # both find no database: they migrate one, not two
    second = start(root, name="second", new_database=True)
    return root, [finish(*first), finish(*second)]


@pytest.fixture(scope="module")
def uninterrupted(two_runs_at_once) -> dict:
    """The figures of an uninterrupted run of the same config (deterministic on CPU): those of the two runs at once,
    which agree with each other (result_of_both)."""
    root, _ = two_runs_at_once
    return result_of_both(root)


@pytest.mark.slow
@pytest.mark.long
def test_repeated_sigkills_at_random_moments(tmp_path, uninterrupted):
    """Killed twice at seeded random moments (0-2 s after the flow reaches the reward model's, then PPO's saved
    state, or as the stage completes if that comes first), saving every step: no rerun trips over a partial
    checkpoint. (The critic-free kill test kills PPO once more.) A kill is never later than its stage's end: a
    smoke stage takes a fraction of a second, and a later kill could race the whole pipeline's own finish."""
    rng = random.Random(0)
    # each attempt gets past a point of the flow (load-independent), then is killed at a random moment after it,
    # before the stage's output is complete
    points = (
        (lambda: saved_state(tmp_path, "train_reward_model"), lambda: completed(tmp_path, "train_reward_model")),
        (lambda: saved_state(tmp_path, "train_policy_ppo"), lambda: completed(tmp_path, "train_policy_ppo")),
    )
    for attempt, (reached, stage_done) in enumerate(points):
        proc, log = start(tmp_path, name=f"killed{attempt}")
        deadline = time.monotonic() + 240
        while proc.poll() is None and not reached() and time.monotonic() < deadline:
            time.sleep(0.02)
        kill_at = time.monotonic() + rng.uniform(0.0, 2.0)
        while proc.poll() is None and time.monotonic() < kill_at and not stage_done():
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before its kill came"
        kill(proc)
        assert "Traceback" not in log.read_text(), log.read_text()
    finish(*start(tmp_path, name="final"))
    assert_clean_store(tmp_path)
    assert Counter(r.info.status for r in pipeline_runs(tmp_path))["KILLED"] == 2  # each kill landed mid-pipeline
    for stage, key in (("train_reward_model", "reward/train/loss"), ("train_policy_ppo", "objective/kl")):
        (run,) = [r for r in stage_runs(tmp_path, stage) if r.info.status == "FINISHED"]
        logged = steps(tmp_path, run, key)
        assert logged == sorted(set(logged)), f"{stage}: a step logged twice"
    assert result(tmp_path) == uninterrupted


@pytest.mark.slow
def test_two_runs_at_once_on_one_checkout(two_runs_at_once):
    """Two pipelines started together on one output folder, MLflow store and Prefect home: both succeed with the
    same figures, and each stage is computed once (the second waits on the stage's lock, then gets it cached)."""
    tmp_path, outputs = two_runs_at_once

    def summary(output: str) -> list[str]:
        block = output.split("== RLHF pipeline summary", 1)[1].split("\nMLflow run ", 1)[0]
        # the figures; not the line that says which stages came from the cache (that differs between the two)
        return [line for line in block.splitlines() if line.strip() and not line.startswith("stages from the cache")]

    assert summary(outputs[0]) == summary(outputs[1])
    for stage in STAGES:
        assert len(stage_runs(tmp_path, stage)) == 1, stage  # computed once, by one of them
        assert cached(outputs[0]) | cached(outputs[1]) >= {stage}, stage  # the other got the cached result
    for folder in (tmp_path / "out").glob("*/*-*"):
        if folder.is_dir() and not folder.name.startswith("."):
            assert (folder / "manifest.json").is_file() or (folder / "final" / "manifest.json").is_file(), folder
    assert Counter(r.info.status for r in runs(tmp_path)) == Counter(FINISHED=len(STAGES) + 2)
    result_of_both(tmp_path)  # both runs' figures are the same (it asserts so)


def result_of_both(root: Path) -> dict:
    finished = [r for r in pipeline_runs(root) if r.info.status == "FINISHED"]
    assert len(finished) == 2
    figures = [{k: r.data.metrics[k] for k in RESULT_METRICS} for r in finished]
    assert figures[0] == figures[1]
    (manifest,) = (root / "out" / "train_policy_ppo").glob("*/final/manifest.json")
    return {**figures[0], "digest": json.loads(manifest.read_text())["digest"]}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "code"),
    [("ctrl-c", 130), pytest.param("sigterm", 143, marks=pytest.mark.long)],
    ids=["ctrl-c-to-the-terminal-group", "sigterm-to-the-process"],
)
def test_a_run_asked_to_stop_stops_within_seconds_keeps_its_state_and_leaves_nothing(tmp_path, how, code):
    """Ctrl-C (SIGINT to the terminal's whole foreground process group, the temporary Prefect server included) or
    SIGTERM (to the pipeline process alone, as a service manager sends it) while SFT trains: the run stops within
    seconds with exit code 130 or 143 and one line, keeps the SFT state it saved, ends its MLflow runs KILLED, and no
    process it started (the temporary Prefect server) outlives it."""
    import psutil

    proc, log = start(tmp_path, name=how, extra=("sft.steps=3000", "sft.save_every=5"))  # stopped in the middle
    kill_when(proc, lambda: saved_state(tmp_path, "supervised_finetune"), stop=False)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the temporary Prefect server runs beside the pipeline"
    asked = time.monotonic()
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        kill(proc)
        pytest.fail(f"{how}: still running 60 s after it was asked to stop:\n{log.read_text()[-4000:]}")
    took = time.monotonic() - asked
    output = log.read_text()
    assert proc.returncode == code, output
    assert took < 30, f"{how}: {took:.0f} s to stop"
    assert "Traceback" not in output, output
    assert "the last saved training state are kept and the MLflow runs ended KILLED" in output, output
    psutil.wait_procs(children, timeout=10)
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
    assert saved_state(tmp_path, "supervised_finetune"), "the SFT state is kept"
    statuses = {r.data.tags.get("stage", "pipeline"): r.info.status for r in runs(tmp_path)}
    assert statuses == {"prepare_preferences": "FINISHED", "supervised_finetune": "KILLED", "pipeline": "KILLED"}


# -- A killed run in Prefect: Crashed, its slot free, named by the rerun (flows/crashed_runs.py) -------------------


def prefect_rows(root: Path, table: str) -> list[dict]:
    """The flow_run or task_run rows of the pipelines' Prefect database (PREFECT_HOME of `start`), each with its
    state's message and its tags and labels decoded."""
    with sqlite3.connect(root / "prefect" / "prefect.db") as db:
        db.row_factory = sqlite3.Row
        rows = db.execute(
            f"SELECT r.*, s.message AS message FROM {table} r LEFT JOIN {table}_state s ON s.id = r.state_id"
        )
        rows = [dict(row) for row in rows]
    return [
        row | {"tags": json.loads(row["tags"] or "[]"), "labels": json.loads(row.get("labels") or "{}")} for row in rows
    ]


def gpu_slots_taken(root: Path) -> int:
    with sqlite3.connect(root / "prefect" / "prefect.db") as db:
        (taken,) = db.execute("SELECT active_slots FROM concurrency_limit_v2 WHERE name = 'tag:gpu'").fetchone()
    return taken


def make_gpu_limit(prefect_home: Path) -> None:
    """A `gpu` tag limit of one slot in that Prefect home, as flows/serve.py (`make ui`) sets it on the shared one."""
    code = (
        "from flows.prefect_home import prepare_prefect_database\n"
        "from prefect.client.orchestration import get_client\n"
        "prepare_prefect_database()\n"
        "with get_client(sync_client=True) as client:\n"
        "    client.create_concurrency_limit(tag='gpu', concurrency_limit=1)\n"
    )
    env = {
        **os.environ,
        "PREFECT_HOME": seed_prefect_home(prefect_home),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, capture_output=True, timeout=180)


@pytest.mark.slow
@pytest.mark.long
def test_sigkill_mid_critic_free_ppo_leaves_a_crashed_flow_run_the_rerun_names(tmp_path):
    """Issue 25 with a critic-free (GRPO) run: SIGKILL mid-PPO leaves its Prefect flow run and PPO task run Running
    and the `gpu` slot (limit 1, as `make ui` sets it) taken. The documented bound for a CLI run: the next run on that
    Prefect home marks them Crashed before its first stage, naming the killed pid, and frees the slot (else its own
    PPO stage would wait for it for ever); it resumes PPO in the same MLflow run and names the crashed run in Prefect
    (a tag) and MLflow (tags of its pipeline run); nothing is left Running, and the policy has no value model."""
    grpo = ("ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4")  # conf/smoke.yaml: ppo.batch_size 16
    make_gpu_limit(tmp_path / "prefect")
    proc, _ = start(tmp_path, name="killed", extra=grpo)
    kill_when(proc, lambda: saved_state(tmp_path, "train_policy_ppo"))
    (killed,) = prefect_rows(tmp_path, "flow_run")
    (killed_ppo,) = [t for t in prefect_rows(tmp_path, "task_run") if t["name"].startswith("train_policy_ppo")]
    assert killed["state_type"] == killed_ppo["state_type"] == "RUNNING"  # nothing reported the end
    assert killed["labels"]["rlhf.process"].split(":")[1] == str(proc.pid)
    assert gpu_slots_taken(tmp_path) == 1  # the PPO stage's slot

    output = finish(*start(tmp_path, name="rerun", extra=grpo))
    flows = {row["id"]: row for row in prefect_rows(tmp_path, "flow_run")}
    crashed, tasks = flows.pop(killed["id"]), prefect_rows(tmp_path, "task_run")
    assert crashed["state_type"] == "CRASHED" and f"pid {proc.pid} on" in crashed["message"], crashed
    assert f"flow run {crashed['name']} marked Crashed" in output
    assert {t["state_type"] for t in tasks if t["id"] == killed_ppo["id"]} == {"CRASHED"}
    assert [r["name"] for r in [*flows.values(), *tasks] if r["state_type"] in ("RUNNING", "PENDING")] == []
    assert gpu_slots_taken(tmp_path) == 0
    (rerun,) = flows.values()
    assert rerun["state_type"] == "COMPLETED" and f"resumed-from:{crashed['name']}" in rerun["tags"]
    assert f"crashed flow run {crashed['name']}" in output  # the printed summary

    (run,) = stage_runs(tmp_path, "train_policy_ppo")  # PPO continued its run: every update logged once
    logged = steps(tmp_path, run, "objective/kl")
    assert run.info.status == "FINISHED" and logged == list(range(1, len(logged) + 1)) and len(logged) >= 2
    parents = {r.info.status: r for r in pipeline_runs(tmp_path)}
    assert set(parents) == {"KILLED", "FINISHED"}
    assert parents["KILLED"].data.tags["prefect.flow_run_id"] == killed["id"]
    tags = parents["FINISHED"].data.tags
    assert (
        tags["rlhf.resumed_from_flow_run"] == killed["id"]
        and tags["rlhf.resumed_from_flow_run_name"] == crashed["name"]
    )
    assert tags["rlhf.resumed_from_run"] == parents["KILLED"].info.run_id
    assert tags["stage.train_policy_ppo.resumed_from"] == crashed["name"]
    # the resumed PPO run is a child of the rerun's pipeline run, beside its evaluation, and names the killed one
    (run,) = stage_runs(tmp_path, "train_policy_ppo")
    assert run.data.tags["mlflow.parentRunId"] == parents["FINISHED"].info.run_id
    assert run.data.tags["rlhf.resumed_from_parent_run"] == parents["KILLED"].info.run_id
    (final,) = (tmp_path / "out" / "train_policy_ppo").glob("*/final")
    assert (final / "policy").is_dir() and not (final / "value").exists()  # critic-free: no value model
