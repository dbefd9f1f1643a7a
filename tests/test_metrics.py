"""Metric names and renamed keys: declared once (rlhf/metrics.py, the config sections), the docs generated from them,
and the code logging only what they declare."""

from __future__ import annotations

import ast
import logging
import re

import pytest

from rlhf import metrics
from rlhf.config import load_config
from rlhf.errors import ConfigError
from tests.conftest import REPO

# the first part of a metric key: every namespace the tables declare
NAMESPACES = {key.split("/")[0] for key in metrics.declared_keys()}
KEY = re.compile(r"^[a-z_0-9]+(/[a-z_0-9{}]+)+$")
NOT_METRICS = {"data/dropped.json", "data/lengths.json"}  # MLflow tables of the data stage (docs/metrics.md says so)


def _metric_literals() -> dict[str, set[str]]:
    """Every string (an f-string's holes as `{}`) in rlhf/, flows/ and tasks/ (but rlhf/metrics.py) that looks like a
    key of a declared namespace -> the files that hold it."""
    found: dict[str, set[str]] = {}
    for package in ("rlhf", "flows", "tasks"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "rlhf" / "metrics.py":  # the declarations (and the old names of the renamed ones)
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value
                elif isinstance(node, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                else:
                    continue
                if KEY.match(text) and text.split("/")[0] in NAMESPACES and text not in NOT_METRICS:
                    found.setdefault(text, set()).add(str(path.relative_to(REPO)))
    return found


def _declared(literal: str) -> bool:
    """A literal key, or an f-string's (its holes: any name), or a prefix the code completes (`data/over_`)."""
    if "{}" not in literal and metrics.is_declared(literal):
        return True
    pattern = re.compile("^" + "[a-z0-9_<>]+".join(re.escape(p) for p in literal.split("{}")) + "$")
    return any(pattern.match(key) or key.startswith(literal) for key in metrics.declared_keys())


def test_the_code_logs_only_declared_metrics():
    found = _metric_literals()
    assert len(found) > 100, "the scan reads the code's keys"
    assert {k: sorted(v) for k, v in found.items() if not _declared(k)} == {}
    # the scan is no rubber stamp: an old name, or a typo, is caught
    assert not _declared("eval/ppo_gold") and not _declared("periodic_eval/gld") and _declared("dist/kl_p05")


def test_no_old_metric_name_is_left_in_the_code():
    old = {k: sorted(v) for k, v in _metric_literals().items() if metrics.current_metric_name(k) != k}
    assert old == {}


def test_the_metrics_page_is_generated_from_the_declarations():
    page = REPO / "docs" / "metrics.md"
    text = page.read_text()
    assert metrics.metrics_page(text) == text, "run `make docs` to regenerate docs/metrics.md"
    for key in ("periodic_eval/gold", "eval/policy_gold", "reward/best_eval_accuracy", "time/sft"):
        assert f"`{key}`" in text
    with pytest.raises(ValueError, match="no <!-- metrics:ppo:start -->"):
        metrics.metrics_page("# Metrics\n")


def test_old_metric_names_map_to_the_new_ones():
    assert metrics.current_metric_name("eval/ppo_gold") == "eval/policy_gold"
    assert metrics.current_metric_name("ppo_eval/kl") == "periodic_eval/kl"
    assert metrics.current_metric_name("reward/eval_accuracy") == "reward/best_eval_accuracy"
    assert metrics.current_metric_name("time/policy_train_s") == "time/policy_train"
    assert metrics.current_metric_name("eval/win_rate_gold") == "eval/win_rate_gold"
    assert metrics.earlier_metric_names("periodic_eval/gold") == ["ppo_eval/gold"]
    assert metrics.earlier_metric_names("objective/kl") == []


def test_runs_of_an_earlier_release_read_under_todays_names(tmp_path):
    """A run logged with the old names (before this release) is compared, ranked and replayed under the new ones."""
    from rlhf.tracking.client import Tracker

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "old-runs", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("pipeline-old")
    tracker.log_metrics(run_id, {"eval/ppo_gold": 0.5, "ppo_eval/gold": 0.25}, step=0)
    tracker.log_metrics(run_id, {"ppo_eval/gold": 0.75}, step=2)
    tracker.end_run(run_id)
    record = next(r for r in tracker.search_runs() if r.run_id == run_id)
    assert record.metrics["eval/policy_gold"] == 0.5 and "eval/ppo_gold" not in record.metrics
    assert tracker.metric_history(run_id, "periodic_eval/gold") == [(0, 0.25), (2, 0.75)]


def test_renamed_config_keys_still_read_with_one_warning(caplog, monkeypatch):
    from rlhf.config import base

    monkeypatch.setattr(base, "_warned", set())  # once per process: this test sees its own
    with caplog.at_level(logging.WARNING, logger="rlhf.config"):
        config = load_config(None, ["ppo.eval_prompts=8", "ppo.kl_target=3", "sft.warmup_steps=15"])
    assert (config.ppo.eval_n_prompts, config.ppo.adaptive_kl_target) == (8, 3.0)
    assert config.sft.warmup_ratio == 15 / config.sft.steps  # a count of steps becomes the fraction it was
    warned = [r.getMessage() for r in caplog.records if r.name == "rlhf.config"]
    assert any("ppo.eval_prompts is renamed ppo.eval_n_prompts" in line for line in warned), warned
    assert all("\n" not in line for line in warned)
    with pytest.raises(ConfigError, match="ppo.eval_prompts was renamed ppo.eval_n_prompts: give only"):
        load_config(None, ["ppo.eval_prompts=8", "ppo.eval_n_prompts=4"])
    assert "`ppo.kl_target` | `ppo.adaptive_kl_target`" in (REPO / "docs" / "config.md").read_text()
