"""Data-parallel PPO: two CPU processes on gloo through torchrun and accelerate, the helpers, and the sharding."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.config import PPOConfig
from rlhf.data import synthetic
from rlhf.ppo import distributed
from rlhf.ppo.prompts import prompt_batch

# end-to-end: real processes (deselect with -m "not slow"); one xdist worker runs this module and tests/test_fsdp.py,
# which share the reference run (the torchrun_run fixture of tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("torchrun")]

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
TIMEOUT_S = 120
# 2 updates of 16 episodes (8 per rank), 2 minibatches (4 per rank), 2 epochs; a state saved after update 1
TINY = [
    "ppo.total_episodes=32",
    "ppo.batch_size=16",
    "ppo.num_mini_batches=2",
    "ppo.num_ppo_epochs=2",
    "ppo.max_new_tokens=8",
    "ppo.save_every=1",
    "runtime.progress=false",
    "runtime.device=cpu",
    "runtime.dtype=float32",  # float32 numerics: tests/test_fsdp.py compares the sharded run with a tolerance
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a launcher in its own process group; on a timeout the whole group (the workers too) is killed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[:4]} timed out after {timeout} s\n{out[-2000:]}\n{err[-4000:]}")
    finally:
        if proc.poll() is None:  # pragma: no cover - interrupted test
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _launch_args(ck: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [
        "-m",
        "rlhf.ppo.launch",
        "--policy",
        ck["policy"],
        "--reward",
        ck["reward"],
        "--prompts",
        ck["prompts"],
        "--out",
        str(out),
        "--write-param-digest",
        *extra,
        *TINY,
    ]


def _torchrun(ck: dict[str, str], out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    return _run([*cmd, *_launch_args(ck, out, *extra)])


def _digests(out: Path) -> list[str]:
    return [(out / f"param_digest.rank{r}.txt").read_text().strip() for r in range(2)]


def test_torchrun_two_processes_train_in_sync(torchrun_run, launch_inputs):
    out = torchrun_run
    rank0, rank1 = _digests(out)
    assert rank0 == rank1  # gradients averaged: both ranks took the same optimizer steps
    policy = AutoModelForCausalLM.from_pretrained(out / "final" / "policy")
    start = AutoModelForCausalLM.from_pretrained(launch_inputs["policy"])
    moved = [not torch.equal(a, b) for a, b in zip(policy.parameters(), start.parameters(), strict=True)]
    assert any(moved)
    # rank 0 wrote each update's records of the global batch: both ranks' disjoint slices, in the global order
    tok = AutoTokenizer.from_pretrained(launch_inputs["policy"])
    prompts = pd.read_parquet(launch_inputs["prompts"])["prompt"].tolist()
    ids = [x[-PPOConfig().max_prompt_tokens :] for x in tok(prompts, add_special_tokens=False)["input_ids"]]
    for update in (0, 1):
        records = pd.read_parquet(out / "rollouts" / f"update_{update + 1:05d}.parquet")
        expected = prompt_batch(ids, update, 16, 0, tok.pad_token_id).indices
        assert records["prompt"].tolist() == [prompts[i] for i in expected]
    saved = torch.load(out / "state" / "trainer_state.pt", weights_only=True)
    assert saved["world_size"] == 2 and len(saved["sample_rngs"]) == 2
    assert not torch.equal(saved["sample_rngs"][0], saved["sample_rngs"][1])  # each rank samples its own stream


@pytest.mark.long
def test_torchrun_resume_matches_the_uninterrupted_run(torchrun_run, launch_inputs, tmp_path):
    out = tmp_path / "out"
    stopped = _torchrun(launch_inputs, out, "--stop-after", "1")
    # the launcher exits 3; torchrun reports any failed worker as 1 (and stops the other one)
    assert stopped.returncode != 0
    assert torch.load(out / "state" / "trainer_state.pt", weights_only=True)["step"] == 1, stopped.stderr[-4000:]
    assert not (out / "final").exists()
    resumed = _torchrun(launch_inputs, out)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    # every rank reloaded its own sampling generator: the same final parameters as without the interruption
    assert _digests(out) == _digests(torchrun_run)


@pytest.mark.long
@pytest.mark.skipif(not (VENV_BIN / "accelerate").exists(), reason="accelerate's CLI is not installed")
def test_accelerate_launch_matches_torchrun(torchrun_run, launch_inputs, tmp_path):
    # accelerate's torch.distributed path is --multi_gpu; with runtime.device=cpu the ranks use gloo
    out = tmp_path / "out"
    accelerate = [str(VENV_BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    flags = ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    result = _run([*accelerate, *flags, *_launch_args(launch_inputs, out)])
    assert result.returncode == 0, result.stderr[-4000:]
    assert _digests(out) == _digests(torchrun_run)  # same seed, same shards: the same run


@pytest.mark.skipif(not (VENV_BIN / "accelerate").exists(), reason="accelerate's CLI is not installed")
def test_accelerate_cpu_flag_without_mpi_is_an_error(launch_inputs, tmp_path):
    # accelerate launch --cpu starts one process without mpirun: refused rather than silently single-process
    out = tmp_path / "out"
    cmd = [str(VENV_BIN / "accelerate"), "launch", "--cpu", "--num_processes", "2", "--num_machines", "1"]
    flags = ["--mixed_precision", "no", "--dynamo_backend", "no"]
    result = _run([*cmd, *flags, *_launch_args(launch_inputs, out)])
    assert result.returncode != 0  # the launcher exits 2, accelerate reports 1
    assert "error: accelerate launch --cpu starts a single process" in result.stderr
    assert not out.exists()


def test_world_size_must_divide_the_batches():
    cfg = PPOConfig(batch_size=16, num_mini_batches=2, gradient_accumulation_steps=2)
    distributed.check_world_size(cfg, 1)
    distributed.check_world_size(cfg, 2)  # minibatch 8 -> 4 per rank -> micro-batches of 2
    with pytest.raises(ValueError, match=r"ppo.batch_size \(16\) must be divisible by the number of processes \(3\)"):
        distributed.check_world_size(cfg, 3)
    with pytest.raises(ValueError, match=r"minibatch size .* = 8\) must be divisible by the number of processes"):
        distributed.check_world_size(PPOConfig(batch_size=16, num_mini_batches=2), 16)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps \(2\) must divide the per-process"):
        distributed.check_world_size(cfg, 8)


def test_rank_shards_are_disjoint_slices_of_the_global_batch():
    prompt_ids = [[5] * (1 + i % 7) for i in range(50)]
    for update in (0, 3):  # update 3 crosses a pass over the 50 prompts
        full = prompt_batch(prompt_ids, update, 16, 7, pad_id=0)
        shards = [prompt_batch(prompt_ids, update, 16, 7, 0, rank, 4) for rank in range(4)]
        assert sum((s.indices for s in shards), []) == full.indices
        for s in shards:
            assert len(s.indices) == 4
            assert s.ids.shape[1] == max(len(prompt_ids[i]) for i in s.indices)  # padded to its own longest


def test_helpers_are_no_ops_in_one_process():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    distributed.average_gradients([p])
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    stats = {"objective/scores": 1.5, "objective/scores_min": -1.0}
    assert distributed.reduce_stats(stats) == stats
    assert distributed.all_gather_object("x") == ["x"]
    x, mask = torch.tensor([[1.0, 3.0, 99.0]]), torch.tensor([[1, 1, 0]])
    assert [t.item() for t in distributed.masked_mean_var(x, mask)] == [2.0, 2.0]  # its own: mean 2, var 2/1
    assert distributed.broadcast_object(3) == 3


@contextmanager
def gloo_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """A spawned test worker's process group, torn down as a launched run's is (rlhf.ppo.distributed.close_distributed:
    every rank waits for the others first). A worker that tore its group down while the other still used it once died
    with SIGABRT ("terminate called without an active exception") on the 2-core CI machine. A worker that failed
    tears down at once: the others are stopped by torch.multiprocessing.spawn."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    distributed.close_distributed()


def _helpers_worker(rank: int, world_size: int, port: int, results: Path) -> None:
    with gloo_group(rank, world_size, port):
        # gradients: mean over ranks, two dtypes -> two flattened buffers
        a = torch.nn.Parameter(torch.zeros(2, 2))
        b = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        frozen = torch.nn.Parameter(torch.zeros(1))  # no grad on any rank: skipped
        a.grad = torch.full((2, 2), float(rank + 1))  # ranks 1 and 2 -> 1.5
        b.grad = torch.tensor([rank * 2.0, 0.0, 4.0], dtype=torch.float64)  # 0, 2 -> 1
        distributed.average_gradients([a, frozen, b])
        assert torch.equal(a.grad, torch.full((2, 2), 1.5))
        assert torch.equal(b.grad, torch.tensor([1.0, 0.0, 4.0], dtype=torch.float64))
        assert frozen.grad is None
        stats = {
            "objective/scores": float(rank),  # mean of 0, 1 -> 0.5
            "objective/scores_min": -float(rank),  # min -> -1
            "objective/scores_max": float(rank),  # max -> 1
            "memory/peak_mb": 100.0 + rank,  # max -> 101
        }
        reduced = distributed.reduce_stats(stats)
        assert list(reduced) == list(stats)
        assert reduced == {
            "objective/scores": 0.5,
            "objective/scores_min": -1.0,
            "objective/scores_max": 1.0,
            "memory/peak_mb": 101.0,
        }
        module = torch.nn.Linear(2, 2)
        torch.nn.init.constant_(module.weight, float(rank))
        distributed.broadcast_parameters(module)
        assert torch.equal(module.weight, torch.zeros(2, 2))  # rank 0's
        assert distributed.all_gather_object(rank * 10) == [0, 10]
        # whitening moments of the global batch: shards of different shapes, padding ignored
        # real entries rank 0: 1, 3 | rank 1: 5, 7, 9 -> mean 5; squared deviations 16+4+0+4+16 = 40; var 40/4 = 10
        x = [torch.tensor([[1.0, 3.0, 99.0]]), torch.tensor([[5.0, 7.0], [9.0, -99.0]])][rank]
        mask = [torch.tensor([[1, 1, 0]]), torch.tensor([[1, 1], [1, 0]])][rank]
        mean, var = distributed.masked_mean_var(x, mask)
        assert mean.item() == pytest.approx(5.0) and var.item() == pytest.approx(10.0)
        assert distributed.broadcast_object(f"from {rank}") == "from 0"
        distributed.barrier()
        (results / f"ok{rank}").write_text("ok")


def test_helpers_across_two_processes(tmp_path):
    mp.spawn(_helpers_worker, args=(2, _free_port(), tmp_path), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok0", "ok1"]


def test_launcher_writes_no_digest_in_one_process(launch_inputs, tmp_path):
    # no launcher: the single-process path, the same as the pipeline's PPO stage
    out = tmp_path / "out"
    cmd = [sys.executable, *_launch_args(launch_inputs, out)]
    result = _run(cmd)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "on 1 process(es)" in result.stdout
    assert (out / "final" / "policy" / "config.json").is_file()
    assert not list(out.glob("param_digest*"))


def _digest_worker(rank: int, port: int, ck: dict[str, str], prompts: list[str], out: Path, want: bool) -> None:
    from rlhf.config import RuntimeConfig
    from rlhf.ppo.run import PolicyRun
    from rlhf.ppo.trainer import train_ppo

    torch.set_num_threads(1)
    real = distributed.parameter_digest

    def counted(*modules):
        (out / f"digest_called.rank{rank}").write_text("yes")
        return real(*modules)

    distributed.parameter_digest = counted
    with gloo_group(rank, 2, port):
        cfg = PPOConfig(total_episodes=8, batch_size=8, num_mini_batches=1, num_ppo_epochs=1, max_new_tokens=4)
        runtime = RuntimeConfig(device="cpu", progress=False)
        ctx = distributed.DistContext(rank=rank, world_size=2)
        result = train_ppo(
            PolicyRun(cfg, runtime, ck["policy"], ck["reward"], prompts, out, 0, lambda m, s: None, param_digest=want),
            dist=ctx,
        )
        (out / f"digest.rank{rank}").write_text(result.param_digest)


@pytest.mark.parametrize("want", [False, True])
def test_parameter_digest_only_when_asked(tiny_checkpoints, tmp_path, want):
    # hashing every parameter is a test aid: a plain data-parallel run does not pay for it
    prompts = sorted({d.prompt for d in synthetic.demonstrations(50, seed=0)})
    mp.spawn(_digest_worker, args=(_free_port(), tiny_checkpoints, prompts, tmp_path, want), nprocs=2, join=True)
    called = sorted(p.name for p in tmp_path.glob("digest_called.*"))
    digests = [(tmp_path / f"digest.rank{r}").read_text() for r in range(2)]
    if want:
        assert called == ["digest_called.rank0", "digest_called.rank1"]
        assert digests[0] == digests[1] and len(digests[0]) == 64
    else:
        assert called == [] and digests == ["", ""]


def _reinforce_batch() -> tuple[PPOConfig, list]:
    """A global batch of 8 scored responses (2 groups of 4 samples per rank of two), with ragged lengths."""
    from rlhf.rollout.generation import Responses
    from rlhf.rollout.scoring import ScoredResponses

    g = torch.Generator().manual_seed(7)
    b, r = 8, 5
    lengths = torch.tensor([5, 3, 4, 1, 2, 5, 5, 3])
    mask = (torch.arange(r) < lengths[:, None]).long()
    logprobs, ref_logprobs = -torch.rand(b, r, generator=g), -torch.rand(b, r, generator=g)
    scored = ScoredResponses(
        query_responses=torch.zeros(b, 2 + r, dtype=torch.long),
        qr_mask=torch.cat([torch.ones(b, 2, dtype=torch.long), mask], 1),
        prompt_len=2,
        resp=Responses(torch.zeros(b, r, dtype=torch.long), mask, torch.ones(b, dtype=torch.bool)),
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=None,
        scores=torch.randn(b, generator=g),
    )
    cfg = PPOConfig(
        advantage_estimator="reinforce_pp", samples_per_prompt=4, batch_size=8, num_mini_batches=2, total_episodes=8
    )
    return cfg, scored


def _shard(scored, rows: slice):
    import dataclasses

    from rlhf.rollout.generation import Responses

    resp = Responses(*(t[rows] for t in scored.resp))
    tensors = {
        k: getattr(scored, k)[rows] for k in ("query_responses", "qr_mask", "logprobs", "ref_logprobs", "scores")
    }
    return dataclasses.replace(scored, resp=resp, **tensors)


def _whitening_worker(rank: int, world_size: int, port: int, results: Path) -> None:
    from rlhf.ppo.update import Rollout, compute_advantages

    with gloo_group(rank, world_size, port):
        cfg, scored = _reinforce_batch()
        rows = slice(rank * 4, (rank + 1) * 4)
        ctx = distributed.DistContext(rank=rank, world_size=world_size)
        rollout = compute_advantages(Rollout(list(range(4)), _shard(scored, rows)), cfg, 0.05, ctx)
        torch.save(rollout.advantages, results / f"advantages{rank}.pt")


def test_reinforce_pp_whitens_over_the_global_batch_across_processes(tmp_path):
    """Two processes with half the batch each whiten REINFORCE++'s returns with the global batch's moments: the
    advantages are those of one process holding the whole batch, not of each half whitened alone."""
    from rlhf.ppo.update import Rollout, compute_advantages

    mp.spawn(_whitening_worker, args=(2, _free_port(), tmp_path), nprocs=2, join=True)
    sharded = torch.cat([torch.load(tmp_path / f"advantages{r}.pt") for r in range(2)])
    cfg, scored = _reinforce_batch()
    whole = compute_advantages(Rollout(list(range(8)), scored), cfg, 0.05).advantages
    torch.testing.assert_close(sharded, whole, atol=1e-5, rtol=1e-5)
    alone = compute_advantages(Rollout(list(range(4)), _shard(scored, slice(0, 4))), cfg, 0.05).advantages
    assert not torch.allclose(alone, whole[:4], atol=1e-3)  # each half alone would whiten differently
