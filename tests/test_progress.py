"""The data-parallel PPO progress bar (tasks/progress.py): the launcher's printed update lines carry the numbers a
single process shows (score, KL, KL coefficient, gold score), and the bar fed from those lines shows them."""

from __future__ import annotations

from rlhf.ppo.launch import UPDATE_LINE_PATTERN, _printer
from tasks.progress import line_stats, watched_text
from tests.conftest import flow_run_artifacts

METRICS = {
    "objective/scores": 0.5,
    "objective/kl": 0.125,
    "objective/kl_coef": 0.05,
    "objective/gold_score": -0.25,
    "policy/clipfrac": 0.1,
    "speed/episodes_per_s": 12.0,
    "value/loss": 3.0,
}


def test_update_lines_carry_the_watched_numbers(capsys):
    show = _printer(every=2, total=3)
    for step in (1, 2, 3):
        show(METRICS, step)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["ppo update 2", "ppo update 3"]
    stats = line_stats(lines[-1].split(":", 1)[1])
    assert watched_text("ppo", stats) == "score 0.5, KL 0.125, KL coef 0.05, gold -0.25"
    assert line_stats("x: a/b=1e-3, c=-2.5") == {"a/b": 0.001, "c": -2.5}


def test_the_progress_bar_of_a_data_parallel_run_shows_them(capsys, harness):
    from prefect import flow
    from prefect.runtime import flow_run

    from tasks.progress import echo_with_progress

    show = _printer(every=1, total=2)
    for step in (1, 2):
        show({**METRICS, "objective/kl": 0.125 * step}, step)
    printed = capsys.readouterr().out.splitlines()

    @flow
    def watch() -> str:
        echo = echo_with_progress("ppo", 2, UPDATE_LINE_PATTERN)
        for line in ["torchrun banner", *printed]:
            echo(line)
        return flow_run.get_id()

    flow_run_id = watch()
    (bar,) = [a for a in flow_run_artifacts(flow_run_id) if a.type == "progress"]
    assert bar.data == 100.0
    assert bar.description == "ppo: step 2 of 2; score 0.5, KL 0.25, KL coef 0.05, gold -0.25"
