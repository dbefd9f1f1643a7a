"""PPO's periodic evaluation (ppo.eval_every) on a tiny real stack: the steps it logs, KL 0 before the first
update, a callback that stops training, resume without a duplicated evaluation, no effect on training."""

from __future__ import annotations

import math
from collections import defaultdict

import pandas as pd
import pytest

from rlhf.config import PPOConfig, RuntimeConfig
from rlhf.data import synthetic
from rlhf.errors import TrainingInterrupted, TrialPruned
from rlhf.ppo.periodic_eval import is_eval_step, sqrt_kl
from rlhf.ppo.run import PolicyRun
from rlhf.ppo.trainer import train_ppo

RUNTIME = RuntimeConfig(device="cpu", progress=False)
EVAL_KEYS = {
    "periodic_eval/score",
    "periodic_eval/gold",
    "periodic_eval/kl",
    "periodic_eval/sqrt_kl",
    "periodic_eval/length_mean",
}
# the over-optimisation alarm's signs of one reward model, and the alarm (rlhf.eval.overoptimisation)
EVAL_KEYS |= {"periodic_eval/distinct_2", "periodic_eval/identical_share", "periodic_eval/repetition"}
EVAL_KEYS |= {"periodic_eval/score_std", "periodic_eval/near_identical_share"}  # logged for the alarm's study
EVAL_KEYS |= {"periodic_eval/ref_surprisal"}
EVAL_KEYS |= {"periodic_eval/overoptimisation_alarm", "periodic_eval/overoptimisation_sign"}
PROMPTS = sorted({d.prompt for d in synthetic.demonstrations(200, seed=0)})
HELD_OUT = sorted({d.prompt for d in synthetic.demonstrations(50, seed=1)})[:12]


class Recorder:
    """A `log` that keeps every (step, metrics) call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))

    def eval_steps(self) -> list[int]:
        return [step for step, metrics in self.calls if "periodic_eval/kl" in metrics]

    def eval_at(self, step: int) -> dict[str, float]:
        (metrics,) = [m for s, m in self.calls if s == step and "periodic_eval/kl" in m]
        return metrics


def _cfg(**kw) -> PPOConfig:
    base = dict(
        total_episodes=80,  # 5 updates of 16
        batch_size=16,
        num_mini_batches=2,
        num_ppo_epochs=2,
        max_new_tokens=10,
        lr=3e-3,
        save_every=100,
        record_rollouts=False,
        eval_every=2,
    )
    return PPOConfig(**{**base, **kw})


def _train(tiny_checkpoints, cfg, folder, log, **kw):
    return train_ppo(
        PolicyRun(
            cfg,
            RUNTIME,
            tiny_checkpoints["policy"],
            tiny_checkpoints["reward"],
            PROMPTS,
            folder,
            0,
            log,
            gold_fn=synthetic.gold_score,
            **kw,
        )
    )


def test_eval_steps_are_the_start_every_n_and_the_end():
    cfg = _cfg(eval_every=2)  # 5 updates
    assert [s for s in range(6) if is_eval_step(s, cfg)] == [0, 2, 4, 5]
    assert [s for s in range(6) if is_eval_step(s, _cfg(eval_every=5))] == [0, 5]
    assert not any(is_eval_step(s, _cfg(eval_every=0)) for s in range(6))


def test_sqrt_kl_counts_a_negative_estimate_as_zero_and_keeps_nan():
    assert sqrt_kl(4.0) == 2.0
    assert sqrt_kl(-0.01) == 0.0
    assert math.isnan(sqrt_kl(float("nan")))


def test_periodic_eval_logs_its_metrics_at_the_eval_steps(tiny_checkpoints, tmp_path):
    log = Recorder()
    _train(tiny_checkpoints, _cfg(), tmp_path / "run", log, eval_prompts=HELD_OUT)
    assert log.eval_steps() == [0, 2, 4, 5]
    for step in (0, 2, 4, 5):
        metrics = log.eval_at(step)
        assert set(metrics) == EVAL_KEYS
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert metrics["periodic_eval/sqrt_kl"] == pytest.approx(math.sqrt(max(metrics["periodic_eval/kl"], 0.0)))
        assert -1.5 <= metrics["periodic_eval/gold"] <= 1.0
    assert log.eval_at(0)["periodic_eval/kl"] == pytest.approx(0.0, abs=1e-5)  # the policy is still the reference
    assert all(log.eval_at(step)["periodic_eval/ref_surprisal"] > 0 for step in (0, 2, 4, 5))  # nats per token
    # lr 3e-3 moves the policy: the KL estimate leaves 0 (k1, the mean log-ratio of 12 held-out samples: either sign;
    # -0.10 under bf16, 0.11 in float32)
    assert abs(log.eval_at(5)["periodic_eval/kl"]) > 0.01
    # an evaluation is not a training step: the updates' own statistics are logged at steps 1..5 as before
    assert [s for s, m in log.calls if "objective/kl" in m] == [1, 2, 3, 4, 5]


def test_no_gold_without_a_gold_reward_and_no_eval_without_prompts(tiny_checkpoints, tmp_path):
    log = Recorder()
    train_ppo(
        PolicyRun(
            _cfg(total_episodes=32),
            RUNTIME,
            tiny_checkpoints["policy"],
            tiny_checkpoints["reward"],
            PROMPTS,
            tmp_path / "run",
            0,
            log,
            eval_prompts=HELD_OUT,
        )
    )
    assert log.eval_steps() == [0, 2]
    assert set(log.eval_at(2)) == EVAL_KEYS - {"periodic_eval/gold"}
    quiet = Recorder()
    _train(tiny_checkpoints, _cfg(total_episodes=32), tmp_path / "no-prompts", quiet)
    assert quiet.eval_steps() == []


def test_evaluation_does_not_change_training(tiny_checkpoints, tmp_path):
    """The evaluation samples with its own generator: the updates are those of a run without it."""
    with_eval, without = Recorder(), Recorder()
    _train(tiny_checkpoints, _cfg(total_episodes=48), tmp_path / "a", with_eval, eval_prompts=HELD_OUT)
    _train(tiny_checkpoints, _cfg(total_episodes=48, eval_every=0), tmp_path / "b", without, eval_prompts=HELD_OUT)
    assert without.eval_steps() == []

    def training(rec: Recorder) -> list[float]:
        return [m["objective/kl"] for _, m in rec.calls if "objective/kl" in m]

    assert training(with_eval) == training(without)


def test_on_eval_gets_the_metrics_and_raising_stops_training(tiny_checkpoints, tmp_path):
    seen: list[tuple[int, dict[str, float]]] = []

    def prune_at_two(step: int, metrics: dict[str, float]) -> None:
        seen.append((step, metrics))
        if step == 2:
            raise TrialPruned(f"pruned at step {step}")

    log = Recorder()
    with pytest.raises(TrialPruned, match="pruned at step 2"):
        _train(tiny_checkpoints, _cfg(), tmp_path / "run", log, eval_prompts=HELD_OUT, on_eval=prune_at_two)
    assert [s for s, _ in seen] == [0, 2]
    assert seen[1][1] == log.eval_at(2)  # the logged metrics
    assert max(s for s, _ in log.calls) == 2  # no update after the pruned evaluation
    assert not (tmp_path / "run" / "final").exists()


def test_resume_does_not_repeat_an_evaluation(tiny_checkpoints, tmp_path):
    folder = tmp_path / "run"
    cfg = _cfg(save_every=2)
    first, second = Recorder(), Recorder()
    with pytest.raises(TrainingInterrupted):
        _train(tiny_checkpoints, cfg, folder, first, eval_prompts=HELD_OUT, stop_after=2)
    _train(tiny_checkpoints, cfg, folder, second, eval_prompts=HELD_OUT)
    assert first.eval_steps() == [0, 2]
    assert second.eval_steps() == [4, 5]
    steps = defaultdict(int)
    for step, metrics in first.calls + second.calls:
        for key in metrics:
            steps[key, step] += 1
    assert max(steps.values()) == 1  # no metric logged twice at one step


def test_prefect_does_not_retry_a_pruned_trial():
    from prefect.states import Failed

    from tasks.faults import retry_unless_user_error

    assert retry_unless_user_error(None, None, Failed(data=TrialPruned("pruned at step 4"))) is False
    assert retry_unless_user_error(None, None, Failed(data=RuntimeError("connection reset"))) is True


def test_the_guard_is_written_atomically_so_a_failed_write_keeps_the_previous_one(tmp_path):
    """A run killed while it writes the guard must resume (tests/test_process_faults.py kills one): the guard file is
    either the previous one or the whole new one, never a truncated one that torch.load cannot read."""
    from rlhf.eval.overoptimisation import OveroptimisationAlarm
    from rlhf.ppo.periodic_eval import GUARD_FILE, EvalGuard, load_guard, save_guard

    guard = EvalGuard("warn", OveroptimisationAlarm(in_distribution_std=1.5))
    save_guard(tmp_path, guard)
    broken = EvalGuard("warn", OveroptimisationAlarm(in_distribution_std=2.5))
    broken.unpicklable = lambda: None  # pickling fails part way through the write
    with pytest.raises(Exception, match="pickle|lambda"):
        save_guard(tmp_path, broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == [GUARD_FILE]  # no temporary file left behind
    resumed = load_guard(tmp_path, "stop", 9.9)
    assert resumed.mode == "stop" and resumed.alarm.in_distribution_std == 1.5


def test_the_alarms_sentence_says_what_it_saw_where_the_reward_is_the_verifier():
    """A reward model can be gamed; a verifier is the quality itself: its alarm says the policy drifts without gain,
    and the evaluation stage's check says the responses moved, not that a reward model is gamed."""
    from rlhf.eval.evaluate import overoptimisation_signs
    from rlhf.eval.overoptimisation import OveroptimisationAlarm

    sft = {"distinct_2": 0.8, "score": 0.4, "kl": 0.0}
    collapsed = {"distinct_2": 0.1, "score": 0.4, "kl": 3.0}  # distinct bigrams far below the SFT policy's
    for verified, says in ((False, "games its reward"), (True, "drifts from the SFT policy without gaining")):
        alarm = OveroptimisationAlarm(verified=verified, confirm=1)
        alarm.check(0, sft)
        fired = alarm.check(5, collapsed)
        assert fired is not None and says in fired.sentence() and "from update 5" in fired.sentence()
    frames = [pd.DataFrame({"response": texts}) for texts in (["a b c d e f g h", "i j k l m n"], ["a a a a a a"] * 2)]
    _, model_warning = overoptimisation_signs(*frames, in_distribution_std=0.0)
    _, verifier_warning = overoptimisation_signs(*frames, in_distribution_std=0.0, verified=True)
    assert "gamed reward model" in model_warning[0] and "gamed" not in verifier_warning[0]
    assert "its reward is the verifier" in verifier_warning[0]


def _guard_through(mode: str, points: list[tuple], num_updates: int):
    """An `EvalGuard` fed evaluations (step, score, KL, the reference's surprisal, gold) of a policy told apart at
    each by its weights (the step); the guard and whether the last evaluation stopped training."""
    import torch

    from rlhf.eval.overoptimisation import OveroptimisationAlarm
    from rlhf.ppo.periodic_eval import EvalGuard

    policy = torch.nn.Linear(2, 1, bias=False)
    guard, stopped = EvalGuard(mode, OveroptimisationAlarm()), False
    for step, score, kl, surprisal, _ in points:
        with torch.no_grad():
            policy.weight.fill_(step)
        stats = {"distinct_2": 0.3, "score": score, "kl": kl, "ref_surprisal": surprisal}
        metrics = {f"periodic_eval/{key}": value for key, value in stats.items()}
        stopped = guard.observe(step, metrics, policy, last=step == num_updates)
        if stopped:
            break
    return guard, stopped


def _history(points: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"step": s, "periodic_eval/score": sc, "periodic_eval/kl": kl, "periodic_eval/distinct_2": 0.3}
            | {"periodic_eval/ref_surprisal": su, "periodic_eval/gold": g}
            for s, sc, kl, su, g in points
        ]
    )


def test_stop_and_keep_best_keep_the_policy_from_before_the_evidence_as_the_replay_does():
    """A fast fall: at update 10 the SFT model's surprisal at the responses jumped 0.55 nats in 5 updates (0.11 an
    update and 0.55 a nat of KL gained: evidence, though 0.6 over step 0's is under the rule's 1.3) while the score
    still climbs; the rule holds from 15 (the score stalled, the surprisal 1.6 up) and, confirmed at 20, the alarm
    fires there. `stop` and `keep_best` keep update 5's policy, not 10's or 15's, and the replay of the recorded
    evaluations keeps the same."""
    from rlhf.eval.overoptimisation import replay

    # (step, score, KL, the reference's surprisal, gold): the gold fell at 10
    points = [(0, 0.0, 0.0, 1.0, 0.0), (5, 1.0, 1.0, 1.05, 0.8), (10, 1.5, 2.0, 1.6, -0.5)]
    points += [(15, 1.5, 2.2, 2.6, -0.9), (20, 1.5, 2.3, 2.7, -0.9), (25, 1.5, 2.4, 2.7, -0.9)]
    for mode, kept in (("stop", 5), ("keep_best", 5), ("warn", None)):
        guard, stopped = _guard_through(mode, points, 25)
        assert guard.alarm.fired is not None and guard.alarm.fired.step == 20 and stopped == (mode == "stop")
        assert guard.alarm.quiet == [True, True, False, False, False, False][: len(guard.alarm.quiet)]
        if kept is None:
            assert guard.kept() is None
        else:
            step, parameters = guard.kept()
            assert step == kept and parameters["weight"].eq(kept).all()
            assert "before the alarm or its first sign" in guard.outcome(20)
    replayed = replay(_history(points))
    assert replayed["alarm_step"] == 20 and replayed["gold_if_stopped"] == 0.8  # update 5's gold


def test_a_rule_that_holds_once_is_taken_back_but_its_policy_is_never_kept():
    """The rule holds at 15 (the score stalled while the surprisal rose 1.4) and not at 20 (the score climbs again):
    no alarm, training goes on, and `stop` would never keep 15's policy; at the run's last evaluation the rule
    holding once is enough (nothing can take it back)."""
    from rlhf.eval.overoptimisation import replay

    points = [(0, 0.0, 0.0, 1.0, 0.0), (5, 1.0, 1.0, 1.05, 0.5), (10, 1.5, 2.0, 1.1, 0.8), (15, 1.5, 2.1, 2.4, 0.7)]
    points += [(20, 2.5, 2.2, 1.5, 0.9)]
    guard, stopped = _guard_through("stop", points, 25)
    assert guard.alarm.fired is None and not stopped and guard.alarm.quiet == [True, True, True, False, True]
    assert guard.last_quiet_step == 20
    ending = points + [(25, 2.5, 2.3, 2.6, 0.2)]  # the last evaluation: the rule holds, once
    guard, stopped = _guard_through("stop", ending, 25)
    assert guard.alarm.fired.step == 25 and stopped and guard.kept()[0] == 20
    assert replay(_history(ending))["gold_if_stopped"] == 0.9
