"""Checks that run before anything is loaded: a bad path or an unreachable model is one sentence, early."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from rlhf.config import PipelineConfig
from rlhf.config.sections import TRACKING_URI_ENV, tracking_uri_origin
from rlhf.data.row_columns import check_wanted
from rlhf.data.source_checks import check_source
from rlhf.errors import ConfigError
from rlhf.eval.benchmark import read_benchmark
from rlhf.memory import StageEstimate, plan_memory
from rlhf.models.model_config import config_device_type, model_positions, read_model_config
from rlhf.rollout.reward_function import load_reward_functions
from rlhf.tracking.store import check_tracking_uri


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def check_model_reference(key: str, name: str) -> None:
    """A model reference is a local checkpoint folder or, with hub access, a hub id."""
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return
        if (path / "adapter_config.json").is_file():
            raise ConfigError(
                f"{key}: {name} is a LoRA (peft) adapter, not a model: merge it into its base model "
                "(merge_and_unload) and save that with save_pretrained"
            )
        raise ConfigError(f"{key}: folder {name} has no config.json (is it a save_pretrained checkpoint?)")
    if path.is_file():
        raise ConfigError(
            f"{key}: {name} is a file; name the folder that holds the model's config.json, weights and tokenizer"
        )
    if name.startswith((".", "/", "~")) or path.suffix:
        raise ConfigError(f"{key}: checkpoint folder {name} does not exist")
    if hub_offline():
        raise ConfigError(
            f"{key}: '{name}' is not a local folder and hub downloads are off (HF_HUB_OFFLINE=1); "
            "download it first or run with HF_HUB_OFFLINE=0"
        )


def check_sft_model(config: PipelineConfig) -> None:
    """sft.model is a checkpoint folder that loads, a hub id, or a GGUF file (a .gguf path, or sft.gguf_file in the
    folder or repository sft.model) that transformers can dequantise."""
    sft = config.sft
    assert sft.model is not None
    from rlhf.models.gguf import check_gguf, gguf_reference  # heavy: torch, only where a checkpoint is named

    ref = gguf_reference(sft.model, sft.gguf_file)
    key = "sft.gguf_file" if sft.gguf_file else "sft.model"
    if ref is not None:
        check_gguf(key, ref, sft.revision)
        return
    check_model_reference("sft.model", sft.model)
    from rlhf.models.loading import check_checkpoint  # heavy: torch and transformers

    check_checkpoint("sft.model", sft.model, sft.revision, config.runtime.trust_remote_code)


def preflight(config: PipelineConfig) -> list[StageEstimate]:
    """Everything that can be checked without loading a model or reading the data set: paths, the data's format
    and columns where cheap, lengths against the model's positions and memory against the device (only
    config.json is read). Returns the per-stage memory estimates."""
    check_inputs(config)
    return check_fit(config)


def check_inputs(config: PipelineConfig) -> None:
    """The half of `preflight` that checks what the user named: the tracking store, the device's name, the output
    folder, the data source and the SFT checkpoint. Without sft.model it needs neither torch nor transformers (a
    fraction of a second)."""
    try:  # first: a tracking server that is down fails before any work
        check_tracking_uri(config.tracking.uri)
    except ConfigError as err:
        if tracking_uri_origin(config.tracking.uri) != TRACKING_URI_ENV:
            raise
        raise ConfigError(f"{err} (tracking.uri came from ${TRACKING_URI_ENV}; unset it or set tracking.uri)") from None
    check_device(config.runtime.device)
    check_output_dir(config.runtime.output_dir)
    check_source(config.data)
    check_reward_function(config)
    for bench in config.eval.benchmarks:  # every row checked: a bad one is named before a model loads
        read_benchmark(bench.name, bench.path, bench.verifier, bench.n_prompts)
    if config.sft.model is not None:
        check_sft_model(config)
    check_ensemble_models(config)


def check_ensemble_models(config: PipelineConfig) -> None:
    """Each model of reward.ensemble_models is a checkpoint folder that loads, or a hub id; with sft.model set and
    gae's separate value model, member 0 (where the value model starts) reads the policy's tokens."""
    models = config.reward.ensemble_models or []
    if not models:
        return
    from rlhf.models.loading import check_checkpoint, load_tokenizer  # heavy: torch and transformers
    from rlhf.models.stop_tokens import same_vocabulary

    trust_remote_code = config.runtime.trust_remote_code
    for k, name in enumerate(models):
        check_model_reference(f"reward.ensemble_models[{k}]", name)
        check_checkpoint(f"reward.ensemble_models[{k}]", name, None, trust_remote_code)
    ppo = config.ppo
    if config.sft.model is None or config.algorithm != "ppo" or ppo.critic_free or ppo.value_model != "separate":
        return
    policy = load_tokenizer(config.sft.model, config.sft.revision, trust_remote_code, config.sft.gguf_file)
    if not same_vocabulary(policy, load_tokenizer(models[0], trust_remote_code=trust_remote_code)):
        raise ConfigError(
            f"reward.ensemble_models[0] ({models[0]}) has another tokenizer than sft.model ({config.sft.model}), and "
            "gae's value model starts from member 0 and scores every policy token: list a model with the policy's "
            "tokenizer first, or set ppo.value_model: policy_head or a critic-free ppo.advantage_estimator"
        )


def check_reward_function(config: PipelineConfig) -> None:
    """reward.function (or each of reward.functions) imports, and every data column it takes by name is one
    data.row_columns keeps (where it scores the policy stage's responses or keeps the warm start's)."""
    if not (config.reward.uses_function or config.warm_start.enabled):
        return
    functions = load_reward_functions(config.reward.function_specs, config.reward.function_weights)
    several = len(functions.functions) > 1
    for i, function in enumerate(functions.functions):
        key = f"reward.functions[{i}]" if several else "reward.function"
        check_wanted(function.spec, function.fn, config.data.row_columns, key)


def check_fit(config: PipelineConfig) -> list[StageEstimate]:
    """The half of `preflight` that checks that the run fits, importing torch and transformers (seconds): the
    processes, the generation backend, lengths against the model's positions and memory against the device. Returns
    the per-stage memory estimates."""
    check_ppo_processes(config)
    check_generation_backend(config)
    model_config = read_model_config(config.sft, config.runtime.trust_remote_code)
    check_lengths(config, model_config)
    return plan_memory(config, config_device_type(config.runtime.device), model_config)


def check_device(device: str) -> None:
    """The device `runtime.device` names is on this machine (before a model is put on it)."""
    if device in ("auto", "cpu"):
        return
    import torch

    if device == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError("runtime.device is 'mps' but this machine has no MPS device; use runtime.device=auto")
        return
    if not torch.cuda.is_available():
        why = "this torch is a build without CUDA" if torch.version.cuda is None else "this machine shows no CUDA GPU"
        raise ConfigError(
            f"runtime.device is '{device}' but {why}; use runtime.device=cpu (or auto), or run on a machine with a "
            "CUDA GPU and a CUDA build of torch"
        )
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(
            f"runtime.device is '{device}' but this machine has {count} CUDA device{'s' * (count != 1)} "
            f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); name one of them"
        )


def check_output_dir(output_dir: str) -> None:
    """`runtime.output_dir` is a folder this process can create and write in (nothing is left behind here): its
    nearest existing folder is writable by this user, and a file can be made there (root passes every permission
    check, but not on a pseudo or read-only file system such as /proc)."""
    path = Path(output_dir).expanduser().absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        what = "is" if existing == path else f"would be inside {existing}, which is"
        raise ConfigError(f"runtime.output_dir: {output_dir} {what} a file, not a folder; name a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"runtime.output_dir: {output_dir} cannot be written ({existing} is not writable by this user); name a "
            "folder you can write in"
        )
    try:
        with tempfile.TemporaryFile(dir=existing):  # deleted at once (never linked, where the system can)
            pass
    except OSError as err:
        raise ConfigError(
            f"runtime.output_dir: {output_dir} cannot be written (no file can be made in {existing}: "
            f"{err.strerror or err}); name a folder you can write in"
        ) from None


def check_lengths(config: PipelineConfig, model_config: Any) -> None:
    """Every configured length fits in the SFT model's positions (the reward and value models share them)."""
    positions = model_positions(model_config)
    if not positions:
        return
    ppo, over = config.ppo, []
    rollout = ppo.max_prompt_tokens + ppo.max_new_tokens
    if rollout > positions:
        over.append(f"ppo.max_prompt_tokens + ppo.max_new_tokens ({ppo.max_prompt_tokens} + {ppo.max_new_tokens})")
    eval_new = config.eval.max_new_tokens
    if eval_new is not None and ppo.max_prompt_tokens + eval_new > positions:
        over.append(f"ppo.max_prompt_tokens + eval.max_new_tokens ({ppo.max_prompt_tokens} + {eval_new})")
    warm_new = config.warm_start.max_new_tokens
    if config.warm_start.enabled and warm_new is not None and ppo.max_prompt_tokens + warm_new > positions:
        over.append(f"ppo.max_prompt_tokens + warm_start.max_new_tokens ({ppo.max_prompt_tokens} + {warm_new})")
    if config.reward.max_length > positions:
        over.append(f"reward.max_length ({config.reward.max_length})")
    if config.sft.finetune and config.sft.max_length > positions:
        over.append(f"sft.max_length ({config.sft.max_length})")
    if not over:
        return
    where = "sft.bootstrap.n_positions" if config.sft.model is None else f"config.json of {config.sft.model}"
    if config.sft.gguf_file or (config.sft.model or "").lower().endswith(".gguf"):
        where = f"the metadata of {config.sft.gguf_file or config.sft.model}"
    keys = ", ".join(over[:-1]) + (" and " if len(over) > 1 else "") + over[-1]
    raise ConfigError(
        f"{keys} {'exceed' if len(over) > 1 else 'exceeds'} the {positions} positions of the SFT model ({where}); "
        "lower them or use a model with more positions"
    )


def check_generation_backend(config: PipelineConfig) -> None:
    """ppo.generation.backend 'vllm' needs a CUDA GPU for the policy, one PPO process and the vllm package."""
    if config.ppo.generation.backend != "vllm":
        return
    from rlhf.rollout.vllm_backend import check_vllm_backend  # heavy: torch; only for the optional vLLM backend

    check_vllm_backend(config_device_type(config.runtime.device), config.runtime.device, config.runtime.ppo_processes)


def check_ppo_processes(config: PipelineConfig) -> None:
    """runtime.ppo_processes splits the PPO batches evenly and, on CUDA, has a device per process; runtime.sharding
    'fsdp' needs several of them."""
    from rlhf.ppo.distributed import check_sharding, check_world_size  # heavy: torch.distributed

    n = config.runtime.ppo_processes
    check_sharding(config.ppo, config.runtime, n)
    if n == 1:
        return

    try:
        check_world_size(config.ppo, n)
    except ConfigError as err:
        raise ConfigError(f"runtime.ppo_processes={n}: {err}") from None
    import torch

    device = config.runtime.device
    wants_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if wants_cuda and n > torch.cuda.device_count():
        raise ConfigError(
            f"runtime.ppo_processes ({n}) is more than the {torch.cuda.device_count()} CUDA devices of this machine"
        )
