"""benchmarks/overhead_bench.py on the smoke config: both variants run, in fresh processes, and agree on the result
figures (the bench's times are its output, never asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PREFECT_DATABASE

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.long
def test_overhead_bench_runs_both_variants_on_the_smoke_config(tmp_path):
    saved = tmp_path / "runs.json"
    command = [sys.executable, "benchmarks/overhead_bench.py", "--config", "conf/smoke.yaml", "--rounds", "1"]
    command += ["--prefect-home-from", str(PREFECT_DATABASE)]  # a migrated database: no 20-30 s of migrations
    proc = subprocess.run([*command, "--json", str(saved)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("overhead: ") and lines[-1].endswith("%")
    assert "the same in both variants" in proc.stdout
    runs = json.loads(saved.read_text())
    (flow,), (library,) = runs["prefect"], runs["library"]
    stages = {"prepare_preferences", "supervised_finetune", "train_reward_model", "train_policy_ppo"}
    assert stages <= set(flow["times"]) and stages <= set(library["times"])
    assert flow["cached"] == []  # every stage computed: an empty store and output folder
    # the PPO loop's metrics went through the Tracker (written by the writer thread, or by the loop at its saves)
    assert flow["seconds"].get("ppo_loop|mlflow", 0) + flow["seconds"].get("ppo_loop|mlflow_writer", 0) > 0
    assert "MLflow in the PPO training loop" in proc.stdout

    again = subprocess.run([*command[:2], "--report", str(saved)], cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == lines[-1]
