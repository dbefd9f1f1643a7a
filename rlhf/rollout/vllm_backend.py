"""PPO's optional vLLM generation backend (``ppo.generation.backend: vllm``, the ``vllm`` extra; docs/models.md).

A vLLM engine runs in the trainer's process on the policy's GPU, with `ppo.generation.gpu_memory_utilization` of
that GPU's memory. It only samples: the policy's weights are pushed into it after every PPO update (LoRA adapters
merged on the way), it gets the prompts as token ids with the built-in sampler's settings and stop tokens, and its
token ids come back as the built-in sampler's `Responses` (same layout, padding and truncation at the first stop
token). Log-probs, values and scores are still computed by the training models (``rlhf.rollout.scoring``).

Written against vLLM 0.33's Python API, using only calls that older 0.x releases have too: ``vllm.LLM`` (in-process
engine), ``LLM.generate`` on ``{"prompt_token_ids": ...}`` prompts with one ``SamplingParams`` per prompt,
``LLM.apply_model`` to reach the model and its ``load_weights`` (which takes Hugging Face checkpoint names and
layouts, as when vLLM loads a checkpoint), ``LLM.reset_prefix_cache`` and ``LLM.sleep`` / ``LLM.wake_up``.
vllm is imported only here, and only when the backend starts.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rlhf.config import PPOConfig, RuntimeConfig
from rlhf.errors import ConfigError
from rlhf.models.training import unwrap
from rlhf.rollout.generation import GenerationSettings, Responses, truncate_at_stop

SEED_LIMIT = 2**31 - 1  # per-request seeds are drawn below this (vLLM keeps them as Python ints)


def check_vllm_backend(device_type: str, device: str = "auto", processes: int = 1) -> None:
    """Refuse ``ppo.generation.backend: vllm`` where it cannot run, in one sentence, before any model loads.

    `device_type` is where runtime.device puts the models ('cuda' or 'cpu'), `device` the configured name and
    `processes` runtime.ppo_processes.
    """
    key = "ppo.generation.backend=vllm"
    if device_type != "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{key} needs a CUDA GPU and this machine has none; use ppo.generation.backend=builtin")
        raise ConfigError(f"{key} runs on the policy's GPU but runtime.device is '{device}'; set runtime.device=cuda")
    if device.startswith("cuda:") and device != "cuda:0":
        raise ConfigError(
            f"{key} runs on the first visible GPU: pick the GPU with CUDA_VISIBLE_DEVICES and set runtime.device=cuda "
            f"instead of '{device}'"
        )
    if processes > 1:
        raise ConfigError(f"{key} runs with one PPO process; set runtime.ppo_processes=1 (it is {processes})")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{key} needs the vllm package: pip install -e '.[vllm]' on the GPU machine")


def sampling_kwargs(settings: GenerationSettings, seed: int | None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` that sample as `settings` do: one response per prompt, the same
    temperature, top-k and nucleus filtering (left at vLLM's defaults, i.e. off, when None), at most
    max_new_tokens tokens, ending at the first of exactly `settings.stop_token_ids` (ignore_eos: vLLM adds no EOS
    ids of its own), token ids only (no detokenizing, no log-probs: the training model computes those)."""
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": settings.temperature,
        "max_tokens": settings.max_new_tokens,
        "stop_token_ids": list(settings.stop_token_ids),
        "ignore_eos": True,
        "seed": seed,
        "detokenize": False,
        "logprobs": None,
    }
    if settings.top_k is not None:
        kwargs["top_k"] = settings.top_k
    if settings.top_p is not None:
        kwargs["top_p"] = settings.top_p
    return kwargs


def engine_kwargs(
    cfg: PPOConfig, runtime: RuntimeConfig, policy_path: str, seed: int, dtype: torch.dtype
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM``: the policy checkpoint in the run's compute dtype, the configured share of
    the GPU's memory, contexts of prompt + response length, sleep mode when asked, no tokenizer (token ids in and
    out)."""
    return {
        "model": policy_path,
        "dtype": str(dtype).removeprefix("torch."),
        "gpu_memory_utilization": cfg.generation.gpu_memory_utilization,
        "max_model_len": cfg.max_prompt_tokens + cfg.max_new_tokens,
        "seed": seed,
        "enable_sleep_mode": cfg.generation.sleep,
        "enable_prefix_caching": True,
        "skip_tokenizer_init": True,
        "trust_remote_code": runtime.trust_remote_code,
        "tensor_parallel_size": 1,
    }


def _lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")


def policy_weights(policy: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The policy's parameters as a Hugging Face checkpoint names and lays them out (what vLLM's ``load_weights``
    reads), one tensor at a time and without copies where nothing is merged.

    Tied weights come once (``named_parameters`` drops the alias; the engine ties them as the checkpoint config
    says). A peft LoRA policy comes merged: each adapted layer's base weight plus its adapters' delta, under the
    base layer's name; the adapter tensors themselves are left out. The policy is not modified.
    """
    model = unwrap(policy)
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        if ".lora_" in name or "original_module" in name:
            continue
        if ".base_layer." not in name:
            yield name.replace(".modules_to_save.default.", "."), param.detach()
            continue
        owner, leaf = name.split(".base_layer.", 1)
        layer = modules[owner]
        weight = param.detach()
        if leaf == "weight" and _lora_layer(layer) and not getattr(layer, "merged", False):
            with torch.no_grad():
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                        weight = weight + layer.get_delta_weight(adapter)
        yield f"{owner}.{leaf}", weight


def responses_from_token_lists(
    token_lists: Sequence[Sequence[int]], settings: GenerationSettings, device: torch.device
) -> Responses:
    """Sampled token ids of each prompt as the built-in sampler returns them: (b, r) right-padded with the pad id,
    r the longest response, truncated after the first stop token, with its mask and which rows stopped."""
    width = max(1, max(len(tokens) for tokens in token_lists))
    past_end = -1  # marks the positions after a row's last token: never a stop id (the pad id can be one: EOS)
    tokens = torch.full((len(token_lists), width), past_end, dtype=torch.long)
    for row, ids in enumerate(token_lists):
        tokens[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    resp = truncate_at_stop(tokens, settings.stop_token_ids, settings.pad_token_id)
    beyond = tokens == past_end
    return Responses(
        resp.tokens.masked_fill(beyond, settings.pad_token_id).to(device),
        resp.mask.masked_fill(beyond, 0).to(device),
        resp.contains_stop.to(device),
    )


class VLLMSampler:
    """Samples PPO responses with a vLLM engine; called like ``rlhf.rollout.generation.sample_responses`` without the
    model.

    `llm` is a ``vllm.LLM`` (or anything with its ``generate``, ``apply_model``, ``reset_prefix_cache``, ``sleep``
    and ``wake_up``), `params_cls` builds its sampling parameters (``vllm.SamplingParams``). With `sleep`, the
    engine's weights and KV cache are released after each generation and taken back, with the policy's current
    weights, before the next. With `seed_requests`, each prompt's request gets a seed drawn from the caller's
    generator (reproducible from the run's seed and resume state).
    """

    def __init__(
        self,
        llm: Any,
        policy: nn.Module,
        params_cls: Callable[..., Any],
        sleep: bool = False,
        seed_requests: bool = True,
    ) -> None:
        self.llm = llm
        self.policy = policy
        self.params_cls = params_cls
        self.sleep = sleep
        self.seed_requests = seed_requests
        self.asleep = False

    def sync_weights(self) -> float:
        """Push the policy's current weights into the engine (after each PPO update); returns the seconds it took.

        Asleep (sleep mode), the engine holds no weights: they are pushed when it wakes for the next generation.
        """
        if self.asleep:
            return 0.0
        t0 = time.perf_counter()
        weights = policy_weights(self.policy)
        self.llm.apply_model(lambda model: model.load_weights(weights))
        self.llm.reset_prefix_cache()  # cached prompt states were computed with the previous weights
        return time.perf_counter() - t0

    def request_seeds(self, n: int, generator: torch.Generator | None) -> list[int | None]:
        if not self.seed_requests:
            return [None] * n
        device = generator.device if generator is not None else "cpu"
        return torch.randint(0, SEED_LIMIT, (n,), generator=generator, device=device).tolist()

    @torch.no_grad()
    def __call__(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        settings: GenerationSettings,
        generator: torch.Generator | None = None,
    ) -> Responses:
        """Responses to left-padded prompts. Shape: prompt_ids, prompt_mask (b, p) -> Responses with (b, r)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep = False
            self.sync_weights()
            self.llm.wake_up(tags=["kv_cache"])
        prompts = [
            {"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(prompt_ids, prompt_mask, strict=True)
        ]
        params = [self.params_cls(**sampling_kwargs(settings, s)) for s in self.request_seeds(len(prompts), generator)]
        with torch.autocast(prompt_ids.device.type, enabled=False):  # the engine computes in its own dtype
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        token_lists = [list(output.outputs[0].token_ids) for output in outputs]
        if self.sleep:
            self.llm.sleep(level=2)  # weights and KV cache released until the next generation
            self.asleep = True
        return responses_from_token_lists(token_lists, settings, prompt_ids.device)

    def close(self) -> None:
        """Shut the engine down and give its GPU memory back."""
        if getattr(_STARTED, "sampler", None) is self:
            del _STARTED.sampler
        llm, self.llm = self.llm, None
        if llm is None:
            return
        shutdown = getattr(getattr(llm, "llm_engine", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        except ImportError:  # a stand-in engine without vllm
            return
        cleanup_dist_env_and_memory()


# The engine each thread started last: a retry of a failed or interrupted run in the same thread (a Prefect task
# retry) closes it before starting its own, so no engine outlives its run's GPU memory. Sweep variants run in
# threads of their own and never close each other's.
_STARTED = threading.local()


def start_vllm_sampler(
    cfg: PPOConfig,
    runtime: RuntimeConfig,
    policy_path: str,
    policy: nn.Module,
    device: torch.device,
    seed: int,
    dtype: torch.dtype,
    world_size: int = 1,
) -> VLLMSampler:
    """Start a vLLM engine on the policy's GPU from the policy checkpoint and push the policy's current weights
    into it (a resumed run's, LoRA adapters merged). Raises ConfigError where the backend cannot run."""
    check_vllm_backend(device.type, str(device), world_size)
    previous = getattr(_STARTED, "sampler", None)
    if previous is not None:
        previous.close()
    # the engine in this process (no engine-core subprocess), so that the model's load_weights is reached in place
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(cfg, runtime, policy_path, seed, dtype))
    sampler = VLLMSampler(llm, policy, SamplingParams, cfg.generation.sleep, cfg.generation.seed_requests)
    sampler.sync_weights()
    if sampler.sleep:
        llm.sleep(level=2)
        sampler.asleep = True
    _STARTED.sampler = sampler
    return sampler
