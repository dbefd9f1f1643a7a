"""The `rlhf` command (rlhf/cli.py): every subcommand's help, exit codes of user errors, no Prefect at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf import cli

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def rlhf(*args: str, cwd: Path = REPO, exe: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = [*(exe or [sys.executable, "-m", "rlhf.cli"]), *args]
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
    # Only the rlhf package is importable (as after `pip install -e .`); the CLI adds the checkout for the flows, and
    # the config path is relative to the current folder.
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); import rlhf.cli; sys.path.remove({str(REPO)!r}); "
        "code = rlhf.cli.main(['run', '--config', 'missing.yaml']); "
        "print(sys.modules['flows.pipeline'].__file__); sys.exit(code)"
    )
    proc = rlhf(cwd=tmp_path, exe=[sys.executable, "-c", code])
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "missing.yaml" in proc.stderr, proc.stderr
    assert proc.stdout.strip() == str(REPO / "flows" / "pipeline.py")


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
    code = "import sys, rlhf.cli; assert not any(m.split('.')[0] == 'prefect' for m in sys.modules), 'prefect'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_only_the_library_is_installed():
    # flows/ and tasks/ are folders of the checkout, not top-level packages in site-packages (pyproject.toml)
    assert 'include = ["rlhf*"]' in (REPO / "pyproject.toml").read_text()
