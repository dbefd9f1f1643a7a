"""Git LFS pointer files: what a clone without git-lfs holds in place of data files and model weights."""

from __future__ import annotations

import os
from pathlib import Path

LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"
LFS_POINTER_MAX_BYTES = 1024  # the Git LFS spec: pointer files are smaller than this


def is_lfs_pointer(path: Path) -> bool:
    """A Git LFS pointer file (what a clone without git-lfs holds instead of the data): a small text file starting
    ``version https://git-lfs.github.com/spec/v1``."""
    try:
        if not path.is_file() or path.stat().st_size >= LFS_POINTER_MAX_BYTES:
            return False
        with open(path, "rb") as f:
            return f.read(len(LFS_POINTER)) == LFS_POINTER
    except OSError:
        return False


def lfs_pointers(folder: Path) -> list[Path]:
    """The Git LFS pointer files under a folder (hidden files and folders such as .git are skipped)."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in sorted(files) if not f.startswith(".") and is_lfs_pointer(Path(root) / f)]
    return found
