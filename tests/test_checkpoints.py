"""atomic_dir: a crash between its two renames, fsync before the swap, stale folders, a full disk."""

from __future__ import annotations

import os
import random

import pytest
import torch

from rlhf import checkpoints
from rlhf.checkpoints import atomic_dir, load_trainer_state, save_trainer_state


def _trainer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched, random.Random(seed)


def _crash_on_call(monkeypatch, n: int) -> None:
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) >= n:  # this rename and every later one: the process is dying
            raise OSError("simulated crash")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_a_crash_between_the_two_renames_keeps_the_previous_state(tmp_path, monkeypatch):
    folder = tmp_path / "state"
    model, opt, sched, rng = _trainer(0)
    save_trainer_state(folder, model, opt, sched, rng, {"step": 1})
    first = {k: v.clone() for k, v in model.state_dict().items()}
    torch.nn.init.zeros_(model.weight)
    with monkeypatch.context() as patch:
        _crash_on_call(patch, 2)  # old folder moved aside, the new one not yet in place
        with pytest.raises(OSError, match="simulated crash"):
            save_trainer_state(folder, model, opt, sched, rng, {"step": 2})
    # a restart finds the previous state, not a fresh start at step 0, and nothing is left beside it
    again, opt2, sched2, rng2 = _trainer(1)
    saved = load_trainer_state(folder, again, opt2, sched2, rng2, torch.device("cpu"))
    assert saved is not None and saved["step"] == 1
    torch.testing.assert_close(again.state_dict(), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_the_swap_fsyncs_the_new_files_and_cleans_stale_folders(tmp_path, monkeypatch):
    final = tmp_path / "out"
    stale_old, stale_tmp = tmp_path / ".out.old-99999", tmp_path / ".out.tmp-abc"
    stale_old.mkdir()
    stale_tmp.mkdir()
    (tmp_path / ".other.old-1").mkdir()  # another folder's: left alone
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with atomic_dir(final) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.bin").write_bytes(b"a")
        (tmp / "b.txt").write_text("b")
    assert any(p.endswith("/sub/a.bin") for p in synced) and any(p.endswith("/b.txt") for p in synced)
    assert str(tmp_path) in synced  # the renames are durable too
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.old-1", "out"]
    assert (final / "sub" / "a.bin").read_bytes() == b"a"


def test_recovery_restores_the_newest_complete_previous_folder(tmp_path):
    folder = tmp_path / "state"
    older, newer = tmp_path / ".state.old-1", tmp_path / ".state.old-2"
    for path, step in ((older, "1"), (newer, "2")):
        path.mkdir()
        (path / "step").write_text(step)
    os.utime(older, (1, 1))
    assert checkpoints.restore_interrupted_swap(folder) is True
    assert (folder / "step").read_text() == "2"
    assert checkpoints.restore_interrupted_swap(folder) is False  # nothing to do once the folder is there


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    import errno

    from rlhf.errors import CheckpointWriteError

    folder = tmp_path / "state"
    model, opt, sched, rng = _trainer(0)
    save_trainer_state(folder, model, opt, sched, rng, {"step": 1})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointWriteError) as err:
        save_trainer_state(folder, model, opt, sched, rng, {"step": 2})
    assert str(err.value) == f"no space left on the device while writing {folder}; the previous checkpoint is intact"
    assert isinstance(err.value.__cause__, OSError)
    monkeypatch.undo()
    saved = load_trainer_state(folder, *_trainer(1), torch.device("cpu"))
    assert saved is not None and saved["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]

    with pytest.raises(CheckpointWriteError, match=r"while writing .*fresh; there was no previous checkpoint$"):
        with atomic_dir(tmp_path / "fresh"):
            full()
