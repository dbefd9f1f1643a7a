"""Whether the estimate fits the device, before anything loads: the preflight's check (`plan_memory`, as
runtime.memory_check says) and, when a stage does not fit, the settings that would make it fit, in one sentence."""

from __future__ import annotations

from typing import Any

from rlhf.config import PipelineConfig, apply_overrides
from rlhf.errors import ConfigError
from rlhf.memory.estimates import FIT_SHARE, GIB, ModelShape, StageEstimate, estimate, fmt_gib, shape_of
from rlhf.memory.usage import available_memory, process_rss
from rlhf.models.model_config import read_model_config


# Settings that lower the estimate, as overrides, tried one at a time (then together) when a run does not fit.
def _remedies(config: PipelineConfig) -> list[str]:
    ppo = config.ppo
    out: list[str] = []
    if not ppo.gradient_checkpointing:
        out.append("ppo.gradient_checkpointing=true")
    if ppo.value_model == "separate" and not ppo.critic_free:
        out.append("ppo.value_model=policy_head")
    if not ppo.lora.enabled:
        out.append("ppo.lora.enabled=true")
    accum = ppo.gradient_accumulation_steps
    if ppo.mini_batch_size // accum > 1:
        more = accum * 2
        while ppo.mini_batch_size % more:
            more += 1
        out.append(f"ppo.gradient_accumulation_steps={more}")
    if (ppo.forward_batch_size or ppo.batch_size) > 8:
        out.append("ppo.forward_batch_size=8")
    if config.sft.finetune and not config.sft.gradient_checkpointing:
        out.append("sft.gradient_checkpointing=true")
    if not config.reward.gradient_checkpointing:
        out.append("reward.gradient_checkpointing=true")
    if config.reward.batch_size > 4:
        out.append(f"reward.batch_size={config.reward.batch_size // 4}")
    return out


def check_fits(
    config: PipelineConfig, shape: ModelShape, device_type: str, budget: float, base_rss: float = 0.0
) -> list[StageEstimate]:
    """Raise one ConfigError sentence when a stage's estimate exceeds the budget, naming settings that would fit."""
    estimates = estimate(config, shape, device_type, base_rss)
    worst = max(estimates, key=lambda e: e.total)
    if worst.total <= FIT_SHARE * budget:
        return estimates
    fits = FIT_SHARE * budget

    def need(overrides: list[str]) -> float | None:
        try:
            changed = PipelineConfig.model_validate(apply_overrides(config.model_dump(), overrides))
            return max(e.total for e in estimate(changed, shape, device_type, base_rss))
        except ValueError:  # a combination the config refuses
            return None

    # settings of the stages that do not fit, one at a time; else the fewest of them together, in order
    over = {e.stage for e in estimates if e.total > fits}
    remedies = [r for r in _remedies(config) if r.split(".", 1)[0] in over]
    fixes = [f"{r} ({fmt_gib(n)})" for r in remedies if (n := need([r])) is not None and n <= fits]
    for count in range(1, len(remedies) + 1):
        n = need(remedies[:count]) if not fixes else None
        if n is not None and n <= fits:
            fixes.append(f"{', '.join(remedies[:count])} together ({fmt_gib(n)})")
            break
    hint = (
        "; it would fit with " + " or ".join(fixes[:3])
        if fixes
        else "; no single setting here makes it fit (use a smaller model or a larger device)"
    )
    device = "GPU" if device_type == "cuda" else "RAM"
    raise ConfigError(
        f"runtime.memory_check: the {worst.stage} stage needs about {fmt_gib(worst.total)} but {fmt_gib(budget)} of "
        f"{device} is free{hint}, or set runtime.memory_check=warn to try anyway"
    )


def budget_bytes(config: PipelineConfig, device_type: str) -> float:
    rt = config.runtime
    if getattr(rt, "memory_budget_gb", None):
        return rt.memory_budget_gb * GIB
    index = None
    if device_type == "cuda" and ":" in rt.device:
        index = int(rt.device.split(":", 1)[1])
    return available_memory(device_type, index)


def plan_memory(config: PipelineConfig, device_type: str, model_config: Any | None = None) -> list[StageEstimate]:
    """Preflight: estimate every stage and check it against the device's free memory (`runtime.memory_check`)."""
    shape = shape_of(
        model_config if model_config is not None else read_model_config(config.sft, config.runtime.trust_remote_code)
    )
    base = process_rss() if device_type == "cpu" else 0.0
    mode = getattr(config.runtime, "memory_check", "error")
    if mode == "off":
        return estimate(config, shape, device_type, base)
    try:
        return check_fits(config, shape, device_type, budget_bytes(config, device_type), base)
    except ConfigError as err:
        if mode == "error":
            raise
        import warnings

        warnings.warn(str(err), stacklevel=2)
        return estimate(config, shape, device_type, base)
