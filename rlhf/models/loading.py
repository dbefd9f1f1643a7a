"""The one place checkpoints are loaded: every stage loads through the ``Auto*`` classes from a path or hub id,
exactly as it would load ``gpt2``; the tiny bootstrap model is saved with ``save_pretrained`` and loaded the same
way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from rlhf.config import RuntimeConfig
from rlhf.errors import ConfigError
from rlhf.lfs import is_lfs_pointer
from rlhf.models.device import MODEL_BUILD_LOCK, run_dtype
from rlhf.models.gguf import gguf_path, gguf_reference, tokenizer_from_gguf

hf_logging.set_verbosity_error()  # load reports and shard progress bars are noise in pipeline logs
hf_logging.disable_progress_bar()


def hub_kwargs(revision: str | None, trust_remote_code: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision:
        kwargs["revision"] = revision
    return kwargs


def load_options(runtime: RuntimeConfig, device: torch.device, trainable: bool) -> dict[str, Any]:
    """Keyword arguments of `load_causal_lm` / `load_reward_model` under `runtime`.

    A trained model gets float32 master weights (a bf16 checkpoint too) and computes under `autocast`; a frozen
    one (reward model, evaluation) is loaded in the runtime dtype. PPO's reference is the exception
    (`load_reference_lm`): it must compute what the policy computes.
    """
    return {
        "trust_remote_code": runtime.trust_remote_code,
        "dtype": torch.float32 if trainable else run_dtype(runtime, device),
        "attn_implementation": runtime.attn_implementation,
    }


def from_pretrained_with(auto_class: Any, name: str, attn_implementation: str | None, **kwargs: Any) -> PreTrainedModel:
    """`auto_class.from_pretrained` with an attention kernel; 'sdpa' falls back to the model's default (eager) for
    architectures without an sdpa implementation (Gemma-2: its attention logits are soft-capped)."""
    with MODEL_BUILD_LOCK:
        try:
            return auto_class.from_pretrained(name, attn_implementation=attn_implementation, **kwargs)
        except ValueError:
            if attn_implementation != "sdpa":
                raise
        return auto_class.from_pretrained(name, **kwargs)  # transformers' choice: sdpa where it can, else eager


def load_tokenizer(
    name: str, revision: str | None = None, trust_remote_code: bool = False, gguf_file: str | None = None
) -> PreTrainedTokenizerBase:
    """Load a tokenizer (a GGUF file's: `name` ending in .gguf, or `gguf_file` inside the folder or repository
    `name`); one without a pad token pads with its EOS token (masks, not ids, mark padding here). One with neither
    cannot pad a batch: a ConfigError sentence naming it."""
    ref = gguf_reference(name, gguf_file)
    if ref is not None:
        tok = tokenizer_from_gguf(gguf_path("tokenizer", ref, revision))
    else:
        tok = AutoTokenizer.from_pretrained(name, **hub_kwargs(revision, trust_remote_code))
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ConfigError(no_pad_sentence(name))
        tok.pad_token = tok.eos_token
    return tok


def no_pad_sentence(name: str) -> str:
    return (
        f"the tokenizer of {name} has neither a pad token nor an EOS token, so batches cannot be padded; set "
        '"pad_token" (or "eos_token") in its tokenizer_config.json, e.g. "pad_token": "<|endoftext|>"'
    )


# -- Checks of a checkpoint folder before anything is loaded (preflight) ------------------------------------------

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
OTHER_WEIGHTS = ("tf_model.h5", "flax_model.msgpack", "model.ckpt.index")
SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors format's own bound on its JSON header


def check_checkpoint(key: str, name: str, revision: str | None = None, trust_remote_code: bool = False) -> None:
    """A local checkpoint folder (config key `key`) can be loaded, each problem one ConfigError sentence naming the
    key and the file: config.json parses and names a model type this transformers knows (or code of its own, which
    needs runtime.trust_remote_code); the weights are there and not cut short (safetensors headers and sizes, the
    shards of an index, the zip directory of a pytorch_model.bin); the tokenizer loads, has a vocabulary that fits the
    model's embeddings, and can pad (a pad or an EOS token). Only headers are read: seconds for any size. A hub id is
    left to the config check and the loaders."""
    path = Path(name).expanduser()
    if not path.is_dir():
        return
    config = _config_json(key, path)
    _check_model_code(key, path, config, trust_remote_code)
    _check_weights(key, path)
    _check_tokenizer(key, path, config, revision, trust_remote_code)


def _lfs_sentence(key: str, file: Path) -> str:
    return (
        f"{key}: {file} is a Git LFS pointer, not the file: the repository was cloned without git-lfs; run "
        "`git lfs pull` in it"
    )


def _config_json(key: str, path: Path) -> dict[str, Any]:

    file = path / "config.json"
    if is_lfs_pointer(file):
        raise ConfigError(_lfs_sentence(key, file))
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        where = f" at line {err.lineno}" if isinstance(err, json.JSONDecodeError) else ""
        raise ConfigError(
            f"{key}: {file} is not valid JSON{where}; the download may be incomplete: download it again"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: {file} holds a JSON {type(config).__name__}, not a model config")
    if "model_type" not in config:
        raise ConfigError(
            f"{key}: {file} has no model_type: it is not the config of a transformers checkpoint (save_pretrained)"
        )
    return config


def _check_model_code(key: str, path: Path, config: dict[str, Any], trust_remote_code: bool) -> None:
    """A model type this transformers has; else code of the folder's own (config.json's auto_map), which is only run
    with runtime.trust_remote_code and must be in the folder."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config["model_type"]
    auto_map = config.get("auto_map") if isinstance(config.get("auto_map"), dict) else {}
    if model_type in CONFIG_MAPPING:
        return
    if "AutoConfig" not in auto_map:
        raise ConfigError(
            f"{key}: {path} is a '{model_type}' model, which transformers {transformers.__version__} does not know "
            "and the folder has no code for (config.json has no auto_map); upgrade transformers, or check that the "
            "folder is the model you meant"
        )
    if not trust_remote_code:
        raise ConfigError(
            f"{key}: {path} is a '{model_type}' model that runs code of its own ({auto_map['AutoConfig']}, "
            "config.json's auto_map); set runtime.trust_remote_code: true if you trust that code"
        )
    for reference in auto_map.values():
        for ref in reference if isinstance(reference, list) else [reference]:
            if isinstance(ref, str) and "--" not in ref:  # "repo--module.Class" lives in another repository
                module = ref.rsplit(".", 1)[0]
                if not (path / f"{module}.py").is_file():
                    raise ConfigError(
                        f"{key}: config.json of {path} names code in {module}.py, which is not in the folder; "
                        "download it with the model"
                    )


def _check_weights(key: str, path: Path) -> None:
    present = [name for name in WEIGHTS if (path / name).is_file()]
    if not present:
        other = [name for name in OTHER_WEIGHTS if (path / name).exists()]
        hint = f" (it has {other[0]}: convert the checkpoint to PyTorch)" if other else ""
        raise ConfigError(
            f"{key}: {path} has no weights (model.safetensors, pytorch_model.bin or a sharded index of them){hint}; "
            "save the model into it with save_pretrained"
        )
    index = next((name for name in present if name.endswith(".index.json")), None)
    if index is not None:
        for shard in _shards(key, path / index):
            _check_weight_file(key, shard)
    else:
        _check_weight_file(key, path / present[0])


def _shards(key: str, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted(set(weight_map.values()))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            f"{key}: {index} is not a readable shard index (JSON with a weight_map); download it again"
        ) from None
    missing = [f for f in files if not (index.parent / f).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(
            f"{key}: {index.parent / missing[0]}{more}, a shard that {index.name} names, is missing; download every "
            "shard of the checkpoint"
        )
    return [index.parent / f for f in files]


def _check_weight_file(key: str, file: Path) -> None:
    """A safetensors file's header parses and its tensors fit in the file; a torch file's zip directory is there."""
    import zipfile

    if is_lfs_pointer(file):
        raise ConfigError(_lfs_sentence(key, file))
    size = file.stat().st_size
    cut = f"{key}: {file} is cut short"
    again = "download it again"
    if file.suffix == ".bin":
        with open(file, "rb") as f:
            head = f.read(4)
        if head.startswith(b"PK") and not zipfile.is_zipfile(file):
            raise ConfigError(f"{cut} (its zip directory is missing, {size} bytes); {again}")
        if not head:
            raise ConfigError(f"{key}: {file} is empty; {again}")
        return
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n > min(size - 8, SAFETENSORS_MAX_HEADER):
            raise ConfigError(f"{cut} or is not a safetensors file ({size} bytes; no complete header); {again}")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError, AttributeError):
            raise ConfigError(f"{key}: {file} has an unreadable safetensors header; {again}") from None
    if 8 + n + end > size:
        raise ConfigError(f"{cut}: {size} bytes where its header needs {8 + n + end}; {again}")


def _check_tokenizer(
    key: str, path: Path, config: dict[str, Any], revision: str | None, trust_remote_code: bool
) -> None:
    try:
        tok = AutoTokenizer.from_pretrained(str(path), **hub_kwargs(revision, trust_remote_code))
    except Exception as err:  # noqa: BLE001 (whatever the tokenizer library says, one sentence)
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"{key}: the tokenizer of {path} cannot be loaded ({why}); save the model's tokenizer into the folder "
            "(tokenizer.save_pretrained)"
        ) from None
    if len(tok) <= len(set(tok.all_special_tokens)):  # transformers makes an empty one for a folder without files
        raise ConfigError(
            f"{key}: {path} has no tokenizer (no tokenizer.json, vocab or sentencepiece file); save the model's "
            "tokenizer into the folder (tokenizer.save_pretrained)"
        )
    if tok.pad_token is None and tok.eos_token is None:
        raise ConfigError(f"{key}: {no_pad_sentence(str(path))}")
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and len(tok) > vocab:
        raise ConfigError(
            f"{key}: the tokenizer of {path} has {len(tok)} tokens but the model's embeddings have {vocab} "
            "(config.json vocab_size): the tokenizer is another model's; use the one saved with the model"
        )


def load_causal_lm(
    name: str,
    device: torch.device,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "sdpa",
) -> PreTrainedModel:
    """A causal LM with weights in `dtype` (whatever dtype the checkpoint was saved in)."""
    kwargs = hub_kwargs(revision, trust_remote_code)
    model = from_pretrained_with(AutoModelForCausalLM, name, attn_implementation, dtype=dtype, **kwargs)
    return model.to(device)


def token_ids(value: int | list[int] | None) -> list[int]:
    """The ids of a config field that holds none, one id or a list of them (Llama 3.1's eos_token_id)."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _pad_id(name: str, config: Any, kwargs: dict[str, Any]) -> int | None:
    """The pad id of a reward model: the tokenizer's (its EOS when it has no pad token), else the first EOS id."""
    try:
        return load_tokenizer(name, **kwargs).pad_token_id
    except (OSError, ValueError):  # a checkpoint without a tokenizer
        return next(iter(token_ids(config.eos_token_id)), None)


def as_scalar_head(config: Any, name: str, kwargs: dict[str, Any]) -> None:
    """Make `config` a one-output regression head: a classifier checkpoint's labels and problem type go (the next
    stage loads what this one saves), and the pad id becomes one int (the tokenizer's)."""
    config.problem_type = None  # regression with one label, whatever the checkpoint was trained for
    config.num_labels = 1  # resets id2label / label2id to one label
    if not isinstance(config.pad_token_id, int):
        config.pad_token_id = _pad_id(name, config, kwargs)


def load_reward_model(
    name: str,
    device: torch.device,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "sdpa",
) -> PreTrainedModel:
    """A sequence classifier with one output: a fresh scalar head when `name` is a causal LM checkpoint or a
    classifier with another number of labels, the trained one when it is a reward model."""
    kwargs = hub_kwargs(revision, trust_remote_code)
    config = AutoConfig.from_pretrained(name, **kwargs)
    labels = config.num_labels
    as_scalar_head(config, name, kwargs)
    model = from_pretrained_with(
        AutoModelForSequenceClassification,
        name,
        attn_implementation,
        config=config,
        dtype=dtype,
        ignore_mismatched_sizes=labels != 1,  # a classifier's head: a fresh scalar head replaces it
        **kwargs,
    )
    return model.to(device)


def is_local_checkpoint(name: str) -> bool:
    """Whether `name` is a folder on this machine (else a hub id)."""
    return Path(name).is_dir()
