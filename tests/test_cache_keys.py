"""Caches that never lie: every runtime setting that changes a stage's numbers is in its cache key (a change makes the
stage compute again), every one that cannot is not (a change finds the same folder and the cached result)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf.config import RuntimeConfig, load_config
from tasks import caching
from tasks.tracking import TrackingContext

REPO = Path(__file__).resolve().parent.parent
STAGES = ("supervised_finetune", "train_reward_model", "train_policy_ppo", "evaluate_policies", "a_new_stage")
MODEL_FREE = ("prepare_preferences", "init_policy_models")  # data preparation, the plan of the PPO models

# (setting, a value, another value)
IN_KEY = [
    ("dtype", "float32", "bfloat16"),
    ("dtype", "float32", "float16"),
    ("attn_implementation", "sdpa", "eager"),
    ("attn_implementation", "sdpa", None),
    ("device", "cpu", "cuda"),
]
OUT_OF_KEY = [
    ("threads", None, 1),
    ("threads", 2, 3),
    ("trust_remote_code", False, True),
    ("output_dir", "outputs", "elsewhere"),
    ("device_slot", None, "gpu-0"),
    ("progress", True, False),
    ("ppo_processes", 1, 2),  # PPO's key has it as `processes`
    ("memory_check", "error", "off"),
    ("memory_budget_gb", None, 8.0),
    ("on_nonfinite", "stop", "skip_update"),
    ("device", "cuda:0", "cuda:1"),
    ("device", "cuda", "cuda:0"),
]


def _key(stage: str, **runtime) -> str:
    config = load_config(REPO / "conf" / "smoke.yaml", [])
    tracking = TrackingContext(uri="sqlite:///unused.db", experiment="e", parent_run_id="p")
    parameters = {
        "data_cfg": config.data,
        "seed": 0,
        "runtime": RuntimeConfig(**{"device": "cpu", **runtime}),
        "tracking": tracking,
    }
    return caching.stage_key(stage, parameters)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("setting", "before", "after"), IN_KEY, ids=[f"{s}={a}" for s, _, a in IN_KEY])
def test_a_setting_that_changes_the_numbers_recomputes_the_stage(stage, setting, before, after):
    assert _key(stage, **{setting: before}) != _key(stage, **{setting: after})


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("setting", "before", "after"), OUT_OF_KEY, ids=[f"{s}={a}" for s, _, a in OUT_OF_KEY])
def test_a_setting_that_cannot_change_the_numbers_keeps_the_cache(stage, setting, before, after):
    assert _key(stage, **{setting: before}) == _key(stage, **{setting: after})


@pytest.mark.parametrize("stage", MODEL_FREE)
@pytest.mark.parametrize(("setting", "before", "after"), IN_KEY, ids=[f"{s}={a}" for s, _, a in IN_KEY])
def test_a_stage_without_a_model_keeps_its_cache_whatever_the_runtime(stage, setting, before, after):
    assert _key(stage, **{setting: before}) == _key(stage, **{setting: after})


def test_sharding_is_in_the_key_of_ppo_only():
    # PPO's resume state is a torch.distributed.checkpoint folder under fsdp, a torch.save file otherwise
    assert _key("train_policy_ppo", sharding="none") != _key("train_policy_ppo", sharding="fsdp")
    for stage in {*STAGES, *MODEL_FREE} - {"train_policy_ppo"}:
        assert _key(stage, sharding="none") == _key(stage, sharding="fsdp")


def test_compiled_training_is_in_the_key_of_ppo_only():
    # fused kernels move the log-probs by about 1e-6; off, the key is the one of runs from before the setting
    assert _key("train_policy_ppo", compile_training=False) != _key("train_policy_ppo", compile_training=True)
    off = RuntimeConfig(device="cpu", dtype="float32")
    assert "compile_training" not in caching.runtime_key("train_policy_ppo", off)
    for stage in {*STAGES, *MODEL_FREE} - {"train_policy_ppo"}:
        assert _key(stage, compile_training=False) == _key(stage, compile_training=True)


def test_auto_resolves_where_that_asks_nothing_of_a_gpu(monkeypatch):
    """'auto' on a CPU is what it resolves to on this machine (float32, or bfloat16 where the CPU's bf16 check passes:
    rlhf/models/cpu_bf16.py): the same key as that dtype, another than the other one. The device 'auto' is the
    device it picks."""
    import torch

    from rlhf.models.device import resolved_dtype_name

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    here = resolved_dtype_name("auto", "cpu")
    other = "float32" if here == "bfloat16" else "bfloat16"
    assert _key("train_reward_model", dtype="auto") == _key("train_reward_model", dtype=here)
    assert _key("train_reward_model", dtype="auto") != _key("train_reward_model", dtype=other)
    assert _key("train_reward_model", device="auto") == _key("train_reward_model", device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _key("train_reward_model", device="auto") == _key("train_reward_model", device="cuda")
    # on a GPU 'auto' stays 'auto' (bfloat16 where the GPU has it): asking would need a CUDA context
    assert _key("train_reward_model", device="cuda", dtype="auto") != _key(
        "train_reward_model", device="cuda", dtype="float32"
    )


def test_every_runtime_setting_is_decided():
    """A new RuntimeConfig field must be put in or out of the key on purpose (and into these tests)."""
    decided = {s for s, _, _ in IN_KEY + OUT_OF_KEY} | {"sharding", "compile_training"}
    assert set(RuntimeConfig.model_fields) == decided


def test_a_stage_folder_follows_its_key(tmp_path):
    """A run with another compute dtype writes (and looks for) another folder: it is computed, not served."""
    config = load_config(REPO / "conf" / "smoke.yaml", [f"runtime.output_dir={tmp_path}"])
    tracking = TrackingContext(uri="sqlite:///unused.db", experiment="e", parent_run_id="p")
    params = {"sft_cfg": config.sft, "prepared": None, "seed": 0, "tracking": tracking}
    float32 = config.runtime.model_copy(update={"dtype": "float32"})
    fp32 = caching.stage_dir("supervised_finetune", {**params, "runtime": float32})
    bf16 = config.runtime.model_copy(update={"dtype": "bfloat16"})
    assert caching.stage_dir("supervised_finetune", {**params, "runtime": bf16}) != fp32
    more_threads = float32.model_copy(update={"threads": 7})
    assert caching.stage_dir("supervised_finetune", {**params, "runtime": more_threads}) == fp32


def _sft_side(*overrides: str) -> Path:
    config = load_config(REPO / "conf" / "smoke.yaml", ["runtime.device=cpu", *overrides])
    return caching.sft_side_dir(config.eval, config.ppo, config.runtime, sft_model="sft-digest", prepared="data")


@pytest.mark.parametrize(
    "overrides",
    [["ppo.lr=1e-4"], ["ppo.kl_coef=0.3"], ["seed=5"], ["ppo.advantage_estimator=rloo", "ppo.samples_per_prompt=4"],
     ["runtime.threads=1"]],
)  # fmt: skip
def test_the_evaluations_sft_side_is_shared_across_training_settings(overrides):
    """Another seed, objective or training setting evaluates the same SFT policy in the same way: the same folder."""
    assert _sft_side(*overrides) == _sft_side()


@pytest.mark.parametrize(
    "override",
    ["eval.seed=7", "eval.n_prompts=8", "ppo.temperature=0.7", "ppo.max_new_tokens=9", "ppo.top_k=5",
     "ppo.max_prompt_tokens=16", "runtime.dtype=float16"],
)  # fmt: skip
def test_what_changes_the_sft_policys_responses_names_another_sft_side(override):
    assert _sft_side(override) != _sft_side()


def test_the_sft_side_keys_the_temperature_the_evaluation_samples_at():
    pinned = ("eval.temperature=0.7", "eval.max_new_tokens=12")
    assert _sft_side(*pinned, "ppo.temperature=1.0") == _sft_side(*pinned, "ppo.temperature=0.5")
    assert _sft_side(*pinned, "ppo.max_new_tokens=30") == _sft_side(*pinned)
    # eval.temperature stated or resolved from ppo.temperature: the same temperature, the same folder
    assert _sft_side("eval.temperature=0.7", "ppo.temperature=0.7") == _sft_side("ppo.temperature=0.7")
    assert _sft_side("eval.length_tolerance=0.5") == _sft_side()
