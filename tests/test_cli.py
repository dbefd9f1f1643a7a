"""The `rlhf` command (flows/cli.py, launched by rlhf/launcher.py): every subcommand's help, exit codes of user
errors, no Prefect at import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import seed_prefect_home

from flows import cli

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def rlhf(*args: str, cwd: Path = REPO, exe: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = [*(exe or [sys.executable, "-m", "flows.cli"]), *args]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def test_top_level_help_lists_every_subcommand():
    proc = rlhf("--help")
    assert proc.returncode == 0, proc.stderr
    for name in cli.COMMANDS:
        assert name in proc.stdout


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_subcommand_help(name):
    proc = rlhf(name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: rlhf {name}")


def test_no_or_unknown_subcommand_is_a_usage_error():
    assert rlhf().returncode == 2
    proc = rlhf("nope")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_bad_override_exits_2_with_one_sentence():
    proc = rlhf("run", "ppo.num_mini_batches=3")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "num_mini_batches" in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout


def test_run_from_outside_the_checkout_finds_the_flows(tmp_path):
    # Only the rlhf package is importable (as after `pip install -e .`); the launcher adds the checkout for the
    # command line and the flows, and the config path is relative to the current folder.
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); import rlhf.launcher; sys.path.remove({str(REPO)!r}); "
        "code = rlhf.launcher.main(['run', '--config', 'missing.yaml']); "
        "print(sys.modules['flows.pipeline_command'].__file__); sys.exit(code)"
    )
    proc = rlhf(cwd=tmp_path, exe=[sys.executable, "-c", code])
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "missing.yaml" in proc.stderr, proc.stderr
    assert proc.stdout.strip() == str(REPO / "flows" / "pipeline_command.py")


def test_console_script():
    script = Path(sys.executable).parent / "rlhf"
    if not script.is_file():
        pytest.skip("the rlhf console script is not installed in this environment")
    where = subprocess.run(
        [sys.executable, "-c", "import rlhf; print(rlhf.__file__)"], cwd="/", capture_output=True, text=True
    ).stdout.strip()
    if Path(where).resolve().parent != REPO / "rlhf":
        pytest.skip(f"the installed rlhf package is another checkout's ({where})")
    proc = rlhf("--help", exe=[str(script)])
    assert proc.returncode == 0, proc.stderr
    assert rlhf("run", "ppo.num_mini_batches=3", exe=[str(script)]).returncode == 2


def test_import_has_no_prefect():
    code = "import sys, flows.cli; assert not any(m.split('.')[0] == 'prefect' for m in sys.modules), 'prefect'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_only_the_library_is_installed():
    # flows/ and tasks/ are folders of the checkout, not top-level packages in site-packages (pyproject.toml)
    assert 'include = ["rlhf*"]' in (REPO / "pyproject.toml").read_text()


@pytest.mark.slow
@pytest.mark.long
def test_ui_stops_every_process_it_started_on_sigterm(tmp_path):
    """`rlhf ui` as a background service (no terminal: the signal reaches its own process only): SIGTERM stops the
    serve process, the Prefect server and the MLflow UI, within a bounded wait, and leaves no process. (SIGINT, a
    terminal's Ctrl-C, takes the same path: the processes have sessions of their own, so only `rlhf ui` gets it.)"""
    signum = signal.SIGTERM
    import httpx
    import psutil

    from tests.conftest import free_port, seed_prefect_home

    prefect_port, mlflow_port = free_port(), free_port()
    env = {**ENV, "PREFECT_HOME": seed_prefect_home(tmp_path / "prefect"), "OMP_NUM_THREADS": "1"}
    env.pop("PREFECT_API_URL", None)
    cmd = [
        sys.executable,
        "-m",
        "rlhf.launcher",  # from a folder that is no checkout: the installed command finds it
        "ui",
        "--prefect-port",
        str(prefect_port),
        "--mlflow-port",
        str(mlflow_port),
    ]
    cmd += [
        "--config",
        str(REPO / "conf" / "smoke.yaml"),
        "--sweep-space",
        str(REPO / "conf" / "sweeps" / "kl_coef.yaml"),
    ]
    log = tmp_path / "ui.log"
    with open(log, "w") as out:
        ui = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # up: both servers answer and the serve process has served its deployments
            assert ui.poll() is None, log.read_text()
            seen |= {p.pid: p for p in psutil.Process(ui.pid).children(recursive=True)}
            try:
                deployments = httpx.post(f"http://127.0.0.1:{prefect_port}/api/deployments/filter", json={}, timeout=5)
                mlflow_up = httpx.get(f"http://127.0.0.1:{mlflow_port}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                time.sleep(1)
                continue
            if mlflow_up and deployments.status_code == 200 and len(deployments.json()) >= 2:
                break
            time.sleep(1)
        else:
            pytest.fail(f"rlhf ui did not come up:\n{log.read_text()[-4000:]}")
        seen |= {p.pid: p for p in psutil.Process(ui.pid).children(recursive=True)}
        assert len(seen) >= 3, seen  # the Prefect server, the MLflow UI, the serve process (and their workers)
        asked = time.monotonic()
        os.kill(ui.pid, signum)
        ui.wait(90)
        took = time.monotonic() - asked
    finally:
        if ui.poll() is None:
            os.killpg(ui.pid, signal.SIGKILL)
            ui.wait()
        for proc in seen.values():
            try:
                if proc.is_running():
                    proc.kill()
            except psutil.Error:
                pass
    assert ui.returncode == 0, log.read_text()[-4000:]
    assert took < 60, f"{took:.0f} s to stop"
    _, alive = psutil.wait_procs(list(seen.values()), timeout=5)
    assert [(p.pid, p.cmdline()[:4]) for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []


@pytest.mark.slow
def test_ctrl_c_while_the_checks_import_torch_is_one_sentence(tmp_path):
    """Ctrl-C to the terminal's process group once the early temporary Prefect server is up, i.e. while the checks
    before the flow import torch and transformers: exit code 130, one sentence and no traceback, the server gone and
    nothing trained."""
    import psutil

    args = [sys.executable, "-m", "flows.cli", "run", "--config", "conf/smoke.yaml"]
    args += [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"runtime.output_dir={tmp_path}/out"]
    env = {**ENV, "PREFECT_HOME": seed_prefect_home(tmp_path / "prefect")}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    children: list = []
    deadline = time.monotonic() + 120
    while not children and proc.poll() is None and time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children(recursive=True)
        time.sleep(0.05)
    assert children, "the temporary Prefect server starts before the checks that import torch"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert "stopped by Ctrl-C (SIGINT)" in err, err
    psutil.wait_procs(children, timeout=10)
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
    assert not (tmp_path / "out" / "supervised_finetune").exists()
