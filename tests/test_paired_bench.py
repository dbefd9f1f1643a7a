"""`python -m benchmarks.paired_bench`: two bench settings taking turns in one process, their paired ratios."""

from __future__ import annotations

import pytest
import torch

from benchmarks import paired_bench
from benchmarks.paired_bench import PHASES, parse_setting, run_pairs, sign_test_p
from benchmarks.ppo_bench import Bench
from benchmarks.shapes import SHAPES, BenchShape

TINY = BenchShape("gpt2", 2, 2, 32, 64, batch_size=8, prompt_len=4, response_len=6, num_mini_batches=2)


def test_settings_parse_and_bad_ones_name_the_key():
    setting = parse_setting("dtype=float32, halves=off decode=dynamic", "b", "grpo")
    assert (setting.dtype, setting.decode, setting.estimator) == ("float32", "dynamic", "grpo")
    assert setting.threading == {"split_policy": False}
    assert setting.describe() == "dtype=float32 decode=dynamic estimator=grpo halves=off"
    assert parse_setting("second_thread=on second_thread=auto", "a", "gae").threading == {}
    compiled = parse_setting("compile_training=on", "b", "gae")
    assert compiled.compile_training == "on" and compiled.describe().endswith("estimator=gae compile_training=on")
    with pytest.raises(paired_bench.SettingError, match=r"--b: halves must be one of auto, on, off, not 'maybe'"):
        parse_setting("halves=maybe", "b", "gae")
    with pytest.raises(paired_bench.SettingError, match=r"--a: 'threads=4' is not one of dtype=\.\.\."):
        parse_setting("threads=4", "a", "gae")


def test_bad_settings_exit_2_with_one_sentence(capsys):
    assert paired_bench.main(["--b", "dtype=float64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "--b: dtype must be one of auto, float32, bfloat16, not 'float64'"
    assert paired_bench.main(["--pairs", "0"]) == 2
    assert "--pairs must be at least 1" in capsys.readouterr().err


def test_sign_test():
    assert sign_test_p(10, 10) == pytest.approx(2 / 1024)
    assert sign_test_p(0, 10) == pytest.approx(2 / 1024)
    assert sign_test_p(5, 10) == 1.0
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(8, 10) == pytest.approx(2 * (1 + 10 + 45) / 1024)


class _Recorder:
    """A bench stand-in that records the order of its updates (run_pairs only calls `update`)."""

    def __init__(self, name: str, order: list[str], seconds: float):
        self.name, self.order, self.seconds = name, order, seconds

    def update(self) -> dict[str, float]:
        self.order.append(self.name)
        return {key: self.seconds for key in PHASES}


def test_pairs_alternate_their_order_after_one_warm_up_each():
    order: list[str] = []
    result = run_pairs(_Recorder("A", order, 2.0), _Recorder("B", order, 1.0), 3, log=lambda line: None)
    assert order == ["A", "B", "A", "B", "B", "A", "A", "B"]
    assert len(result.a) == len(result.b) == 3
    key, a, b, ratio, faster, p = result.rows()[-1]
    assert (key, a, b, ratio, faster, p) == ("time/total", 2.0, 1.0, 0.5, 3, 0.25)


def test_a_forced_threading_is_the_plan_the_update_runs():
    cpu = torch.device("cpu")
    forced = Bench(TINY, cpu, torch.float32, 2, estimator="grpo", threading={"split_policy": True})
    assert forced.plan().split_policy and forced.plan().optimise_threads == 1
    whole = Bench(TINY, cpu, torch.float32, 2, estimator="grpo", threading={"split_policy": False})
    assert not whole.plan().split_policy and whole.plan().optimise_threads is None
    forced.update()  # the halves run
    assert Bench(TINY, cpu, torch.float32, 2, threading={"second_thread": False}).plan().second_thread is False


def test_a_paired_run_on_a_tiny_shape(monkeypatch, capsys):
    monkeypatch.setitem(SHAPES, "tiny", TINY)
    args = ["--shape", "tiny", "--device", "cpu", "--estimator", "grpo", "--pairs", "2"]
    assert paired_bench.main([*args, "--a", "dtype=float32", "--b", "dtype=float32 halves=off"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "A: dtype=float32 decode=auto estimator=grpo (dtype float32)"
    assert out[2] == "B: dtype=float32 decode=auto estimator=grpo halves=off (dtype float32)"
    assert sum(line.startswith("pair ") for line in out) == 2
    assert [line.split()[0] for line in out[-5:-1]] == list(PHASES)
    last = out[-1]
    assert last.startswith("B/A time/total: ") and float(last.split()[2]) > 0 and "of 2 pairs faster with B" in last
