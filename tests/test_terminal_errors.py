"""A bad config or bad data reads the same on the terminal whether preflight or a task inside the flow finds it:
one sentence, exit code 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO


def run_pipeline(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONUNBUFFERED": "1"}
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
def test_bad_data_found_inside_the_flow_is_one_sentence(tmp_path):
    # HH layout, but every pair's two answers are the same: only the full validation inside the task sees it
    path = tmp_path / "pairs.jsonl"
    text = "\n\nHuman: Review of The Silent River:\n\nAssistant: the plot was superb."
    path.write_text("\n".join(json.dumps({"chosen": text, "rejected": text}) for _ in range(40)) + "\n")
    proc = run_pipeline(tmp_path, "data.source=local", f"data.path={path}")
    assert "Beginning flow run" in proc.stdout + proc.stderr
    assert_one_sentence(proc, str(path))
