"""NaN and infinite losses: logged as they are, a one-sentence stop that keeps the last state, or skipped steps."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from rlhf.config import PPOConfig, RewardConfig, RuntimeConfig, SFTConfig
from rlhf.data import synthetic
from rlhf.errors import NonFiniteError
from rlhf.ppo.run import PolicyRun
from rlhf.ppo.trainer import train_ppo
from rlhf.tracking.client import Tracker
from rlhf.train.reward import train_reward_model
from rlhf.train.sft import finetune_sft

HUGE_LR = 1e30  # one AdamW step makes the weights ~1e30: the next forward pass overflows to inf/NaN


def _runtime(mode: str) -> RuntimeConfig:
    return RuntimeConfig(device="cpu", progress=False, on_nonfinite=mode)


@pytest.fixture
def data(tmp_path):
    demos = tmp_path / "sft.parquet"
    pd.DataFrame([{"prompt": d.prompt, "response": d.response} for d in synthetic.demonstrations(32, 0)]).to_parquet(
        demos
    )
    pairs = {}
    for split in ("train", "eval"):
        pairs[split] = tmp_path / f"{split}.parquet"
        rows = synthetic.preference_pairs(16, seed=0, label_noise=0.0, split=split)
        pd.DataFrame([p._asdict() for p in rows]).to_parquet(pairs[split])
    prompts = sorted({d.prompt for d in synthetic.demonstrations(32, 0)})
    return {"demos": demos, "prompts": prompts, **pairs}


def _history(tracker: Tracker, run_id: str, key: str) -> list[float]:
    return [m.value for m in tracker.client.get_metric_history(run_id, key)]


def test_tracker_logs_nan_and_inf_to_sqlite(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "nonfinite", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("nan")
    tracker.log_metrics(run_id, {"a": float("nan"), "b": float("inf"), "c": 1.0}, 3)
    assert math.isnan(_history(tracker, run_id, "a")[0])
    assert _history(tracker, run_id, "b")[0] >= 1.7e308  # the SQLite store keeps inf as the largest float
    assert _history(tracker, run_id, "c") == [1.0]


def test_sft_stops_on_a_nan_loss_in_one_sentence_keeping_the_last_state(tiny_checkpoints, data, tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "nonfinite", str(tmp_path / "artifacts"))
    run_id = tracker.start_run("sft")
    cfg = SFTConfig(model=tiny_checkpoints["policy"], finetune=True, steps=6, batch_size=4, lr=HUGE_LR, save_every=1)
    cfg = cfg.model_copy(update={"warmup_ratio": 0, "max_length": 64})
    with pytest.raises(NonFiniteError) as err:
        finetune_sft(cfg, _runtime("stop"), data["demos"], tmp_path / "sft", 0, tracker.metric_logger(run_id))
    message = str(err.value)
    assert "\n" not in message and message.startswith("SFT stopped at step ")
    assert "sft/loss is nan" in message or "sft/grad_norm is" in message
    step = int(message.split("step ")[1].split(":")[0])
    assert step >= 1 and (tmp_path / "sft" / "state" / "model.safetensors").is_file()  # the last good state
    losses = _history(tracker, run_id, "sft/loss")
    assert any(not math.isfinite(v) for v in losses)  # the NaN reached MLflow

    # skip_update: the run finishes, counting the skipped steps
    logged: dict[int, dict] = {}
    finetune_sft(cfg, _runtime("skip_update"), data["demos"], tmp_path / "skip", 0, lambda m, s: logged.update({s: m}))
    assert max(m.get("sft/skipped_nonfinite", 0) for m in logged.values()) >= 1


def test_reward_training_stops_or_skips_on_nan(tiny_checkpoints, data, tmp_path):
    cfg = RewardConfig(epochs=2, batch_size=4, lr=HUGE_LR, eval_every=100, save_every=1, warmup_ratio=0.0)
    args = (tiny_checkpoints["policy"], data["train"], data["eval"])
    logged: dict[int, dict] = {}
    with pytest.raises(NonFiniteError, match=r"^reward model stopped at step \d+: reward/train/(loss|grad_norm) is"):
        train_reward_model(cfg, _runtime("stop"), *args, tmp_path / "rm", 0, lambda m, s: logged.update({s: m}))
    assert any(not math.isfinite(v) for m in logged.values() for v in m.values())
    assert (tmp_path / "rm" / "state").is_dir()
    logged.clear()
    train_reward_model(cfg, _runtime("skip_update"), *args, tmp_path / "skip", 0, lambda m, s: logged.update({s: m}))
    assert logged[max(logged)].get("reward/train/skipped_nonfinite", 0) >= 1 or any(
        m.get("reward/train/skipped_nonfinite", 0) >= 1 for m in logged.values()
    )


def test_ppo_stops_or_skips_on_nan(tiny_checkpoints, data, tmp_path):
    cfg = PPOConfig(
        total_episodes=16,
        batch_size=8,
        num_mini_batches=2,
        num_ppo_epochs=2,
        max_new_tokens=6,
        lr=HUGE_LR,
        value_lr=HUGE_LR,
        save_every=1,
        record_rollouts=False,
    )
    args = (tiny_checkpoints["policy"], tiny_checkpoints["reward"], data["prompts"])
    logged: dict[int, dict] = {}
    with pytest.raises(NonFiniteError, match=r"^PPO stopped at step 1: (policy|value)/\w+ is"):
        train_ppo(PolicyRun(cfg, _runtime("stop"), *args, tmp_path / "ppo", 0, lambda m, s: logged.update({s: m})))
    assert any(not math.isfinite(v) for m in logged.values() for v in m.values())
    logged.clear()
    result = train_ppo(
        PolicyRun(cfg, _runtime("skip_update"), *args, tmp_path / "skip", 0, lambda m, s: logged.update({s: m}))
    )
    assert result.updates == 2
    assert sum(m["ppo/skipped_nonfinite"] for m in logged.values()) >= 1


def test_prefect_does_not_retry_a_nonfinite_stop():
    from prefect.states import Completed, Failed

    from tasks.faults import retry_unless_user_error

    assert retry_unless_user_error(None, None, Failed(data=NonFiniteError("SFT stopped at step 3"))) is False
    assert retry_unless_user_error(None, None, Failed(data=RuntimeError("CUDA error: device lost"))) is True
    assert retry_unless_user_error(None, None, Completed(data=1)) is True
