"""Whether a run's memory estimate (`rlhf.memory.estimate`) fits the device, before anything loads: the preflight's
check (`plan_memory`, as runtime.memory_check says) and, when a stage does not fit, the settings that would make it
fit, in the one sentence of its ConfigError."""

from __future__ import annotations

from typing import Any

from rlhf.config import PipelineConfig
from rlhf.errors import ConfigError
from rlhf.memory import FIT_SHARE, GIB, ModelShape, StageEstimate, estimate, fmt_gib, read_model_config, shape_of
from rlhf.memory_usage import available_memory, process_rss


# Settings that lower the estimate, tried one at a time (then together) when a run does not fit.
def _remedies(config: PipelineConfig) -> list[tuple[str, dict[str, Any]]]:
    ppo = config.ppo
    out: list[tuple[str, dict[str, Any]]] = []
    if not ppo.gradient_checkpointing:
        out.append(("ppo.gradient_checkpointing=true", {"ppo": {"gradient_checkpointing": True}}))
    if ppo.value_model == "separate" and not ppo.critic_free:
        out.append(("ppo.value_model=policy_head", {"ppo": {"value_model": "policy_head"}}))
    if not ppo.lora.enabled:
        out.append(("ppo.lora.enabled=true", {"ppo": {"lora": {"enabled": True}}}))
    accum = ppo.gradient_accumulation_steps
    if ppo.mini_batch_size // accum > 1:
        more = accum * 2
        while ppo.mini_batch_size % more:
            more += 1
        out.append((f"ppo.gradient_accumulation_steps={more}", {"ppo": {"gradient_accumulation_steps": more}}))
    if (ppo.forward_batch_size or ppo.batch_size) > 8:
        out.append(("ppo.forward_batch_size=8", {"ppo": {"forward_batch_size": 8}}))
    if config.sft.finetune and not config.sft.gradient_checkpointing:
        out.append(("sft.gradient_checkpointing=true", {"sft": {"gradient_checkpointing": True}}))
    if not config.reward.gradient_checkpointing:
        out.append(("reward.gradient_checkpointing=true", {"reward": {"gradient_checkpointing": True}}))
    if config.reward.batch_size > 4:
        out.append(
            (
                f"reward.batch_size={config.reward.batch_size // 4}",
                {"reward": {"batch_size": config.reward.batch_size // 4}},
            )
        )
    return out


def _merge(raw: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    for key, value in change.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _with(config: PipelineConfig, change: dict[str, Any]) -> PipelineConfig:
    return PipelineConfig.model_validate(_merge(config.model_dump(), change))


def check_fits(
    config: PipelineConfig, shape: ModelShape, device_type: str, budget: float, base_rss: float = 0.0
) -> list[StageEstimate]:
    """Raise one ConfigError sentence when a stage's estimate exceeds the budget, naming settings that would fit."""
    estimates = estimate(config, shape, device_type, base_rss)
    worst = max(estimates, key=lambda e: e.total)
    if worst.total <= FIT_SHARE * budget:
        return estimates
    fits = FIT_SHARE * budget

    def need(change: dict[str, Any]) -> float | None:
        try:
            return max(e.total for e in estimate(_with(config, change), shape, device_type, base_rss))
        except ValueError:  # a combination the config refuses
            return None

    # settings of the stages that do not fit, one at a time; else the fewest of them together, in order
    over = {e.stage for e in estimates if e.total > fits}
    remedies = [(t, c) for t, c in _remedies(config) if t.split(".", 1)[0] in over]
    fixes = [f"{text} ({fmt_gib(n)})" for text, change in remedies if (n := need(change)) is not None and n <= fits]
    combined: dict[str, Any] = {}
    for count, (_, change) in enumerate(remedies, start=1):
        combined = _merge(combined, change)
        n = need(combined) if not fixes else None
        if n is not None and n <= fits:
            fixes.append(f"{', '.join(t for t, _ in remedies[:count])} together ({fmt_gib(n)})")
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
    shape = shape_of(model_config if model_config is not None else read_model_config(config))
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
