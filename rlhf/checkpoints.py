"""Atomic writes, content digests, manifests (what stages hand each other) and the trainers' resume state."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.errors import CheckpointWriteError

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


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root` and the folders themselves to the disk (before they are renamed into place)."""
    for folder, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _siblings(final: Path, kind: str) -> list[Path]:
    """The ``.{name}.old-*`` (kind "old") or ``.{name}.tmp-*`` (kind "tmp") folders that atomic_dir leaves beside
    `final` when a process dies mid-swap."""
    return [p for p in final.parent.glob(f".{final.name}.{kind}-*") if p.is_dir()]


def restore_interrupted_swap(final: str | Path, required: str | None = None) -> bool:
    """After a crash between atomic_dir's two renames `final` is missing and the previous folder waits beside it as
    ``.{name}.old-<pid>``: rename the newest such folder (holding the file `required`, when given) back. Returns
    whether it did. Several processes may call this at once (the ranks of a run): one rename wins."""
    final = Path(final)
    if final.exists() or not final.parent.is_dir():
        return False
    olds = [p for p in _siblings(final, "old") if required is None or (p / required).is_file()]
    for old in sorted(olds, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            os.replace(old, final)
        except OSError:
            if final.exists():  # another rank restored it first
                return False
            continue
        for stale in _siblings(final, "tmp"):  # the unfinished new folder
            shutil.rmtree(stale, ignore_errors=True)
        return True
    return False


def _disk_full(err: BaseException) -> bool:
    """ENOSPC anywhere in the exception's chain (libraries wrap OSError), or torch's writer saying so."""
    chain: list[BaseException] = []
    while err is not None and err not in chain and len(chain) < 20:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return any(
        (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e) for e in chain
    )


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `final`, on error it is removed.

    The new files are fsynced before the swap. `final` is first moved aside to ``.{name}.old-<pid>`` and removed
    only once the new folder is in place: a crash between the two renames leaves the previous folder there, and
    `restore_interrupted_swap` (called by the trainers' state loaders) puts it back. Folders left by such crashes
    are removed after the next successful swap.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err):
            previous = "the previous checkpoint is intact" if final.exists() else "there was no previous checkpoint"
            raise CheckpointWriteError(f"no space left on the device while writing {final}; {previous}") from err
        raise
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:  # put the previous folder back at once (a crash here leaves it for the loaders)
        restore_interrupted_swap(final)
        raise
    _fsync_dir(final.parent)
    for stale in [old, *_siblings(final, "old"), *_siblings(final, "tmp")]:
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def stage_lock(folder: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on the stage output `folder` (an ``flock`` of the sibling file ``<folder>.lock``)
    while a stage computes it: a second process computing the same stage waits, then finds the finished output.
    The kernel releases the lock when its holder dies, even of SIGKILL."""
    import fcntl

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator[Any]:
    """A file opened in `mode` under a temporary name beside `path`, written to disk and renamed to `path` when the
    block ends: a crash or a kill mid-write leaves the previous file (or none), never part of one; an exception in
    the block removes the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


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


# The resume state of every trainer (SFT, reward model, PPO) is one folder written in one rename: safetensors
# files of weights (tied weights handled) and ``trainer_state.pt`` with the optimizer, scheduler and RNG states and
# the trainer's own fields (step, data order, ...), only ever loaded with ``torch.load(weights_only=True)``. torch
# is imported inside: data preparation uses this module without it.
TRAINER_STATE_FILE = "trainer_state.pt"
STATE_MODEL_FILE = "model.safetensors"


def write_state(
    folder: str | Path,
    fields: dict[str, Any],
    models: dict[str, torch.nn.Module] | None = None,
    tensor_files: dict[str, dict[str, torch.Tensor]] | None = None,
) -> None:
    """Write a resume state to `folder` atomically (a crash mid-save leaves the previous state intact): each model
    of `models` and each tensor dict of `tensor_files` to the safetensors file it is keyed by, `fields` to
    ``trainer_state.pt``."""
    import torch
    from safetensors.torch import save_file, save_model

    with atomic_dir(folder) as tmp:
        for name, model in (models or {}).items():
            save_model(model, str(tmp / name))
        for name, tensors in (tensor_files or {}).items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / name)
        torch.save(fields, tmp / TRAINER_STATE_FILE)


def read_state(folder: str | Path) -> dict[str, Any] | None:
    """The fields of the resume state in `folder` (None: no state), after putting back a state that a crash
    mid-save left aside."""
    import torch

    folder = Path(folder)
    restore_interrupted_swap(folder, TRAINER_STATE_FILE)  # a crash mid-save: the previous state
    if not (folder / TRAINER_STATE_FILE).is_file():
        return None
    return torch.load(folder / TRAINER_STATE_FILE, map_location="cpu", weights_only=True)


def save_trainer_state(
    folder: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rng: random.Random,
    fields: dict[str, Any],
    tensor_files: dict[str, dict[str, torch.Tensor]] | None = None,
) -> None:
    """The state of a single-model trainer: its weights, optimizer, scheduler, Python and torch RNGs, `fields`."""
    import torch

    state = {
        **fields,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "python_rng": rng.getstate(),
        "torch_rng": torch.get_rng_state(),
    }
    write_state(folder, state, {STATE_MODEL_FILE: model}, tensor_files)


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

    saved = read_state(folder)
    if saved is None:
        return None
    load_model(model, Path(folder) / STATE_MODEL_FILE, device=str(device))
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    rng.setstate(rng_state_tuple(saved["python_rng"]))
    torch.set_rng_state(saved["torch_rng"])
    return saved
