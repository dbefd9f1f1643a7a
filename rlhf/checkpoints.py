"""Atomic writes, content digests, manifests (what stages hand each other) and the trainers' resume state."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import random

    import torch

MANIFEST = "manifest.json"


def file_digest(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def dir_digest(path: str | Path) -> str:
    """Digest of every file under a folder (relative names and contents), ignoring the manifest itself."""
    root = Path(path)
    h = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        h.update(str(file.relative_to(root)).encode())
        h.update(file_digest(file).encode())
    return h.hexdigest()


def text_digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `final` in one rename, on error it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _file_sizes(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def write_manifest(folder: str | Path, **fields: Any) -> dict[str, Any]:
    """Write manifest.json with the folder's content digest and file sizes; returns the manifest."""
    manifest = {**fields, "digest": dir_digest(folder), "files": _file_sizes(Path(folder))}
    atomic_write_text(Path(folder) / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str))
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def is_complete(folder: str | Path) -> bool:
    """A stage output is complete when its manifest exists and every file it lists is there with its size.

    (Sizes, not digests: checking must stay cheap for multi-GB checkpoints.)
    """
    manifest = read_manifest(folder)
    if manifest is None:
        return False
    folder = Path(folder)
    return all(
        (folder / name).is_file() and (folder / name).stat().st_size == size
        for name, size in manifest.get("files", {}).items()
    )


def rng_state_tuple(value: Any) -> Any:
    """A ``random.Random`` state after a round trip through ``torch.save``/``torch.load`` (nested lists) as the
    nested tuples ``Random.setstate`` needs."""
    return tuple(rng_state_tuple(v) for v in value) if isinstance(value, list | tuple) else value


# The resume state of the single-model trainers (SFT, reward model): the model weights (``model.safetensors``,
# tied weights handled), any extra tensor files, and ``trainer_state.pt`` with the optimizer, scheduler, Python
# and torch RNG states and the trainer's own fields (step, data order, ...), only ever loaded with
# ``torch.load(weights_only=True)``. torch is imported inside: data preparation uses this module without it.
TRAINER_STATE_FILE = "trainer_state.pt"
STATE_MODEL_FILE = "model.safetensors"


def save_trainer_state(
    folder: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rng: random.Random,
    fields: dict[str, Any],
    tensor_files: dict[str, dict[str, torch.Tensor]] | None = None,
) -> None:
    """Write the whole state to `folder` in one rename: a crash mid-save leaves the previous state intact."""
    import torch
    from safetensors.torch import save_file, save_model

    with atomic_dir(folder) as tmp:
        save_model(model, str(tmp / STATE_MODEL_FILE))
        for name, tensors in (tensor_files or {}).items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / name)
        state = {
            **fields,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "python_rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(),
        }
        torch.save(state, tmp / TRAINER_STATE_FILE)


def load_trainer_state(
    folder: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rng: random.Random,
    device: torch.device,
) -> dict[str, Any] | None:
    """Restore model, optimizer, scheduler and RNGs from `folder`; returns the saved fields (None: no state)."""
    import torch
    from safetensors.torch import load_model

    folder = Path(folder)
    if not (folder / TRAINER_STATE_FILE).is_file():
        return None
    saved = torch.load(folder / TRAINER_STATE_FILE, map_location="cpu", weights_only=True)
    load_model(model, folder / STATE_MODEL_FILE, device=str(device))
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    rng.setstate(rng_state_tuple(saved["python_rng"]))
    torch.set_rng_state(saved["torch_rng"])
    return saved
