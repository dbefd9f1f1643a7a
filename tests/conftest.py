"""Shared fixtures: an isolated Prefect home, no telemetry, and tiny but real transformers models.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). Every worker is a process of its
own with its own Prefect home (below), its own pytest temporary folders, and its own copy of the session fixtures;
servers bind free loopback ports. On two cores shared by two workers, each worker and the processes it starts use
one torch thread (below). Tests that share an expensive module or session fixture (a Prefect test harness kept for
a module, a trained stack, a reference run) carry `pytest.mark.xdist_group`, so that one worker runs all of them and
builds the fixture once; `pytest_collection_modifyitems` below hands the slow ones out first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import flows  # noqa: F401 (its environment defaults, the flow runs' heartbeat among them, before Prefect's import)

REPO = Path(__file__).resolve().parent.parent
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"


def _prefect_database_template() -> Path:
    """A folder holding a migrated Prefect database with the block types registered (`prepare_prefect_database`),
    built once per machine and Prefect version and shared by every pytest-xdist worker (a file lock): a new database
    costs 20 to 30 s of migrations, paid by every pipeline process, temporary server and test harness on a fresh
    Prefect home; a copy costs milliseconds (`seed_prefect_home`)."""
    folder = Path(tempfile.gettempdir()) / f"rlhf-tests-prefect-database-{version('prefect')}"
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "database.ready").is_file():
            building = Path(f"{folder}.building")
            shutil.rmtree(building, ignore_errors=True)
            code = "from flows.prefect_home import prepare_prefect_database; prepare_prefect_database()"
            env = {
                k: v
                for k, v in os.environ.items()
                if k not in ("PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL")
            }
            env = {k: v for k, v in env.items() if k != "PREFECT_SERVER_DATABASE_CONNECTION_URL"}
            env["PREFECT_HOME"] = str(building)
            subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True)
            shutil.rmtree(folder, ignore_errors=True)
            building.rename(folder)
    return folder


PREFECT_DATABASE = _prefect_database_template()


def seed_prefect_home(home: str | Path) -> str:
    """`home` as a Prefect home whose database is already migrated (a copy of the template): what a pipeline
    process started with PREFECT_HOME=home then finds, as on a machine that ran the pipeline before."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    for name in ("prefect.db", "database.ready"):
        shutil.copyfile(PREFECT_DATABASE / name, home / name)
    return str(home)


# Before prefect is imported anywhere: a private home (results, DB) and no network. mkdtemp: one per process, so
# each pytest-xdist worker (and nothing else on the machine) has its own.
_HOME = seed_prefect_home(tempfile.mkdtemp(prefix="rlhf-tests-prefect-"))
os.environ["PREFECT_HOME"] = _HOME
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

# A pytest-xdist worker (before torch is imported): one OpenMP thread for torch here and in every process the tests
# start (pipelines, servers' flow runs, torchrun ranks inherit it), and threads that sleep rather than spin while they
# wait. Two workers of two spinning threads each on two cores made a training loop 10 to 30 times slower (measured:
# the 250-step SFT of tests/test_ppo_trainer.py's stack 564 s against 21 s); a test or config that asks for more
# threads (runtime.threads, a sweep's share of the cores) still gets them. A plain `pytest` run keeps torch's default.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from rlhf.data import synthetic  # noqa: E402
from rlhf.models.bootstrap import build_tiny_gpt2, build_tokenizer  # noqa: E402
from rlhf.models.loading import load_reward_model  # noqa: E402


def pytest_itemcollected(item):
    """A `long` test is a `slow` one too: the quick loop (`-m 'not slow'`) leaves out what `make test` leaves out."""
    if item.get_closest_marker("long") and not item.get_closest_marker("slow"):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook, which names the groups
def pytest_collection_modifyitems(config, items):
    """On a pytest-xdist worker: the grouped tests and the modules with slow tests first.

    The workers take work units in collection order (`--no-loadscope-reorder`): the grouped tests go first (a group
    shares an expensive fixture: its tests are long together), then the modules with slow tests, then the rest, each
    module's tests in their order. The long units start early and the many short tests fill in at the end, instead of
    a long one starting last while the other worker idles. A plain `pytest` run keeps the usual order."""
    if not hasattr(config, "workerinput"):  # not a pytest-xdist worker
        return
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def phase(item) -> int:
        if item.get_closest_marker("xdist_group"):
            return 0
        return 1 if item.nodeid.split("::")[0] in slow_modules else 2

    items.sort(key=phase)  # stable: the order within a phase is kept


def drain_prefect_services(timeout: float = 60) -> None:
    """Stop this process's Prefect client-side services, as prefect_test_harness does when it exits. Each keeps a
    client of the API it first talked to for the rest of the process: after a test that ran flows in this process
    against a server it then stopped (tests/test_sweep_parallel.py), a later test's task with a tag under its own
    test harness asked the stopped server for a slot of the tag's concurrency limit and waited forever ("Unable to
    acquire concurrency slots on ['tag:gpu']"). A stopped service is started again on its next use."""
    from prefect.concurrency.services import (
        ConcurrencySlotAcquisitionService,
        ConcurrencySlotAcquisitionWithLeaseService,
    )
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (
        APILogWorker,
        EventsWorker,
        ConcurrencySlotAcquisitionService,
        ConcurrencySlotAcquisitionWithLeaseService,
    ):
        service.drain_all(timeout=timeout)


@pytest.fixture(autouse=True)
def _fresh_prefect_services():
    """Every test starts with no Prefect client-side service left over from the one before (drain_prefect_services);
    a test that stops a server it ran flows against drains them itself first, while the server still answers."""
    yield
    drain_prefect_services(timeout=30)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A test that changes torch's thread count in this process (a sweep's variants pin runtime.threads to their
    share of the cores) leaves the next test on the same worker torch's default, whichever test that is."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """A tiny GPT-2 policy and a scalar-head model from it, saved and loadable with the Auto classes."""
    root = tmp_path_factory.mktemp("tiny")
    texts = [d.prompt + d.response for d in synthetic.demonstrations(200, seed=0)]
    tok = build_tokenizer(texts, vocab_size=300)
    policy = build_tiny_gpt2(tok, n_layer=1, n_head=2, n_embd=32, n_positions=256, seed=0)
    policy.save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    reward = load_reward_model(str(root / "policy"), torch.device("cpu"))
    torch.nn.init.normal_(reward.score.weight, std=0.5)  # a non-trivial head, so scores differ
    reward.save_pretrained(root / "reward")
    tok.save_pretrained(root / "reward")
    return {"policy": str(root / "policy"), "reward": str(root / "reward")}


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """family -> the folder of a tiny random checkpoint of that model family (tests/model_zoo.py), built once."""
    from tests.model_zoo import build_family

    root = tmp_path_factory.mktemp("zoo")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_family(family, root / family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def launch_inputs(tiny_checkpoints, tmp_path_factory) -> dict[str, str]:
    """The tiny checkpoints and a prompts file: the inputs of the data-parallel launcher (rlhf.ppo.launch)."""
    import pandas as pd

    root = tmp_path_factory.mktemp("launch")
    prompts = sorted({d.prompt for d in synthetic.demonstrations(200, seed=0)})
    pd.DataFrame({"prompt": prompts}).to_parquet(root / "prompts.parquet", index=False)
    return {**tiny_checkpoints, "prompts": str(root / "prompts.parquet")}


@pytest.fixture(scope="session")
def torchrun_run(launch_inputs, tmp_path_factory) -> Path:
    """One uninterrupted (replicated) data-parallel PPO run of two gloo processes under torchrun: the reference of
    tests/test_distributed.py and tests/test_fsdp.py (both in xdist group 'torchrun', so it runs once)."""
    from tests.test_distributed import _torchrun

    out = tmp_path_factory.mktemp("torchrun") / "out"
    result = _torchrun(launch_inputs, out)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ppo: 2 updates on 2 process(es)" in result.stdout  # rank 0 alone prints it
    assert result.stdout.count("ppo: 2 updates") == 1
    return out


# -- Prefect and other servers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness():
    """A Prefect test harness (a temporary server and database), shared by the tests of a module; its database starts
    as a copy of the migrated template instead of being migrated anew."""
    import prefect.testing.utilities as utilities

    def seeded_mkdtemp() -> str:  # the harness's database folder, its database a copy of the template
        folder = tempfile.mkdtemp()
        shutil.copyfile(PREFECT_DATABASE / "prefect.db", Path(folder) / "prefect-test.db")
        return folder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utilities, "mkdtemp", seeded_mkdtemp)
        with utilities.prefect_test_harness(server_startup_timeout=120):
            patch.undo()
            yield


def prefect_server(tmp: Path, module: list[str], extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """A Prefect server, `python -m <module...>` with `--host 127.0.0.1 --port <free port>` in its own session and its
    own seeded home under `tmp` (log: `tmp/server.log`): yields its API URL once it answers, and stops it (SIGTERM,
    then SIGKILL) at the end."""
    import time

    import httpx

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": seed_prefect_home(tmp / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env |= extra_env or {}
    with open(tmp / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", *module, "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp / "server.log").read_text()
            assert time.monotonic() < deadline, f"the Prefect server ({' '.join(module)}) did not start"
            try:
                if httpx.get(f"{api}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield api
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def shared_prefect_api(tmp_path_factory):
    """The API URL of a `prefect server` this worker starts once (its own seeded home), for the tests whose pipeline
    processes meet Prefect only in passing (what they check is the terminal, MLflow or the training state): with
    PREFECT_API_URL set to it, such a process skips starting a temporary server of its own (about 7 s of CPU each).
    The temporary server's own behaviour is tested where it matters (tests/test_process_faults.py,
    tests/test_temporary_server.py, tests/test_cli.py, tests/test_bad_inputs.py)."""
    yield from prefect_server(tmp_path_factory.mktemp("shared-prefect"), ["prefect", "server", "start"])


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for this worker's session (tests/postgres.py): the tests that use it carry
    `xdist_group("postgres")`, so one worker starts it once. Skips, naming what to install, where there is none."""
    from tests.postgres import start_postgres

    yield from start_postgres(free_port())


def free_port() -> int:
    """A free loopback port for a server a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Reading a flow run back from the Prefect API (the test harness's server) ------------------------------------


def _query(fetch):
    """Run `fetch(client)` against the Prefect API and return its result."""
    import asyncio

    from prefect.client.orchestration import get_client

    async def run():
        async with get_client() as client:
            return await fetch(client)

    return asyncio.run(run())


def stage_name(task_run) -> str:
    """A task run's name without Prefect's suffix: 'train_policy_ppo-3f2' -> 'train_policy_ppo'."""
    return task_run.name.rsplit("-", 1)[0]


def task_runs(flow_run_id) -> list:
    """The task runs of a flow run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return _query(lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))))


def task_states(flow_run_id) -> dict[str, str]:
    """{task name: state name} of a flow run."""
    return {stage_name(t): t.state.name for t in task_runs(flow_run_id)}


def subflow_runs(parent_flow_run_id) -> list:
    """The flow runs started as subflows of a flow run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    parent = FlowRunFilterParentFlowRunId(any_=[parent_flow_run_id])
    return _query(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=parent)))


def flow_run_logs(flow_run_id) -> list[str]:
    """The messages of a flow run's logs (its own and its task runs'), oldest first."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)  # the logs are sent in batches by a background worker
    by_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    return [log.message for log in _query(lambda c: c.read_logs(log_filter=by_run))]


def flow_run_artifacts(flow_run_id) -> list:
    """The artifacts of a flow run, newest first."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.client.schemas.sorting import ArtifactSort

    by_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    return _query(lambda c: c.read_artifacts(artifact_filter=by_run, sort=ArtifactSort.CREATED_DESC))
