"""The process's CPU settings (`rlhf.models.device`): glibc's malloc keeps the memory a step frees (`configure_cpu`);
torch's thread count changed for a block (`torch_threads`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlhf.models.device import torch_threads

# a step that allocates, writes and frees 36 MiB in 4 MiB blocks with glibc's malloc, as a training step does with its
# activations; the page faults of 20 such steps after 3 of warm-up. malloc itself, in the main thread: torch's thread
# pools make which arena serves a tensor, and so glibc's default behaviour, vary from run to run.
_STEP_FAULTS = textwrap.dedent(
    """
    import ctypes, resource, sys
    from rlhf.models.device import configure_cpu
    if sys.argv[1] == "configured":
        configure_cpu(None)
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    BLOCK = 4 << 20
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def step():
        blocks = [libc.malloc(BLOCK) for _ in range(9)]
        for block in blocks:
            ctypes.memset(block, 1, BLOCK)
        for block in blocks:
            libc.free(block)
    for _ in range(3):
        step()
    before = faults()
    for _ in range(20):
        step()
    print(faults() - before)
    """
)

NEW_PAGES = 20 * 4 * 256  # at least one 4 MiB block of new 4 KiB pages per step


def _step_faults(mode: str, **env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", _STEP_FAULTS, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_configured_process_reuses_freed_memory_instead_of_faulting_in_new_pages():
    default = _step_faults("default")
    configured = _step_faults("configured")
    assert default > NEW_PAGES  # glibc's own thresholds hand the freed blocks back and fault them in again
    assert configured < default / 100


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_malloc_tunables_the_user_set_are_left_alone():
    map_every_block = "glibc.malloc.mmap_threshold=1048576"
    assert _step_faults("configured", GLIBC_TUNABLES=map_every_block) > NEW_PAGES


def test_torch_threads_sets_the_count_inside_and_restores_it_after():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(1):  # restored on an exception too
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with torch_threads(None):  # None: left as it is
        assert torch.get_num_threads() == before
