"""runtime.sharding 'fsdp': FSDP2-sharded PPO models on two CPU processes (gloo), against the replicated path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf.config import PipelineConfig, PPOConfig, RuntimeConfig, load_config
from rlhf.errors import ConfigError
from rlhf.models import sharding
from rlhf.ppo import distributed
from rlhf.ppo.run import PolicyRun
from rlhf.ppo.trainer import train_ppo
from rlhf.preflight import check_ppo_processes
from rlhf.rollout.forwards import policy_forward
from rlhf.rollout.generation import GenerationSettings, sample_responses
from tests.test_distributed import _digests, _free_port, _torchrun, gloo_group

FSDP = "runtime.sharding=fsdp"
# one xdist worker runs this module and tests/test_distributed.py: the replicated reference run (the torchrun_run
# fixture of tests/conftest.py) is shared with it
pytestmark = pytest.mark.xdist_group("torchrun")


# --- configuration: one sentence naming the key, before any model is loaded ---------------------------------------


def test_sharding_is_off_by_default_and_checked():
    assert RuntimeConfig().sharding == "none"
    with pytest.raises(ConfigError, match="runtime.sharding"):
        load_config(None, ["runtime.sharding=zero3"])
    fsdp = RuntimeConfig(sharding="fsdp")
    distributed.check_sharding(PPOConfig(), fsdp, 2)
    distributed.check_sharding(PPOConfig(lora={"enabled": True}), RuntimeConfig(), 1)  # 'none': anything goes
    with pytest.raises(ConfigError, match=r"^runtime.sharding 'fsdp' needs several processes: set runtime.ppo_"):
        distributed.check_sharding(PPOConfig(), fsdp, 1)
    refused = {
        "ppo.lora.enabled": PPOConfig(lora={"enabled": True}),
        "ppo.value_model=policy_head": PPOConfig(value_model="policy_head"),
        "ppo.generation.backend=vllm": PPOConfig(generation={"backend": "vllm"}),
        "ppo.eval_every > 0": PPOConfig(eval_every=5),
    }
    for key, cfg in refused.items():
        with pytest.raises(ConfigError, match=rf"^runtime.sharding 'fsdp' does not work with {key}; use runtime"):
            distributed.check_sharding(cfg, fsdp, 2)


def test_preflight_and_trainer_refuse_fsdp_in_one_process(tmp_path):
    with pytest.raises(ConfigError, match="needs several processes"):
        check_ppo_processes(PipelineConfig(runtime={"sharding": "fsdp"}))
    check_ppo_processes(PipelineConfig(runtime={"sharding": "fsdp", "ppo_processes": 2}))
    # the trainer checks before it loads anything: the missing checkpoints are never reached
    runtime = RuntimeConfig(device="cpu", sharding="fsdp", progress=False)
    with pytest.raises(ConfigError, match="needs several processes"):
        train_ppo(
            PolicyRun(PPOConfig(), runtime, "/missing/policy", "/missing/reward", ["a"], tmp_path, 0, lambda m, s: None)
        )


# --- the sharded model itself: two gloo processes --------------------------------------------------------------------


def _model_worker(rank: int, port: int, policy_path: str, results: Path) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, 2, port):
        model = AutoModelForCausalLM.from_pretrained(policy_path)
        plain = AutoModelForCausalLM.from_pretrained(policy_path)
        full_bytes = sharding.parameter_bytes(plain)
        sharding.shard_model(model, torch.device("cpu"), 2)
        assert sharding.is_sharded(model) and not sharding.is_sharded(plain)
        local = sharding.parameter_bytes(model)
        assert sum(distributed.all_gather_object(local)) == full_bytes  # disjoint shards: about half on each rank
        assert local < 0.6 * full_bytes
        (results / f"bytes{rank}").write_text(f"{full_bytes} {local}")

        # lock-step sampling: rank 0's rows all stop at the first token, rank 1's never; both ranks run 6 forwards
        # and each gets the tokens (and leaves the generator where) an unsharded loop of its own would
        g = torch.Generator().manual_seed(rank)
        query = torch.randint(3, 200, (2, 5), generator=g)
        query_mask = torch.ones_like(query)
        stops = tuple(range(300)) if rank == 0 else ()
        settings = GenerationSettings(6, 1.0, None, None, stops, pad_token_id=0)
        gen, gen_plain = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        resp = sharding.call(model, sample_responses, query, query_mask, settings, gen, lockstep=True)
        expected = sample_responses(plain, query, query_mask, settings, gen_plain)
        assert resp.tokens.shape[1] == (1 if rank == 0 else 6)
        assert torch.equal(resp.tokens, expected.tokens) and torch.equal(resp.mask, expected.mask)
        assert torch.equal(gen.get_state(), gen_plain.get_state())
        sharding.reshard(model)

        # gradients: reduce-scattered (averaged) by FSDP = all-reduced and averaged by hand; clipping the same
        qr, mask = torch.cat([query, resp.tokens], 1), torch.cat([query_mask, resp.mask], 1)
        sharding.call(model, policy_forward, qr, mask, 5, 1.0).logprobs.sum().backward()
        policy_forward(plain, qr, mask, 5, 1.0).logprobs.sum().backward()
        distributed.average_gradients(plain.parameters())
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert isinstance(p, torch.distributed.tensor.DTensor), name
            torch.testing.assert_close(sharding.full(p.grad), q.grad, rtol=1e-5, atol=1e-7, msg=name)
        norm = sharding.clip_grad_norm(model.parameters(), 0.5)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5))

        # the whole weights, gathered on rank 0 under save_pretrained's names (the tied LM head left out)
        weights = sharding.full_state_dict(model)
        if rank == 0:
            expected_names = set(plain.state_dict()) - {"lm_head.weight"}
            assert set(weights) == expected_names
            for name in expected_names:
                assert torch.equal(weights[name], plain.state_dict()[name]), name
        else:
            assert weights == {}
        (results / f"ok{rank}").write_text("ok")


@pytest.mark.slow  # about 10 s on an idle 2-core machine (two processes build and shard the model)
def test_sharded_model_across_two_processes(tiny_checkpoints, tmp_path):
    mp.spawn(_model_worker, args=(_free_port(), tiny_checkpoints["policy"], tmp_path), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.glob("ok*")) == ["ok0", "ok1"]
    (full0, local0), (_, local1) = ((int(x) for x in (tmp_path / f"bytes{r}").read_text().split()) for r in (0, 1))
    assert local0 + local1 == full0


# --- whole PPO runs under torchrun -----------------------------------------------------------------------------------


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return {
        f"{part}/{k}": v
        for part in ("policy", "value")
        for k, v in load_file(out / "final" / part / "model.safetensors").items()
    }


@pytest.fixture(scope="module")
def fsdp_run(launch_inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp") / "out"
    result = _torchrun(launch_inputs, out, FSDP)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ppo: 2 updates on 2 process(es)" in result.stdout
    return out


@pytest.mark.slow
def test_fsdp_trains_as_the_replicated_data_parallel_run(fsdp_run, torchrun_run, launch_inputs):
    # torchrun_run: the replicated run of the same inputs and settings (tests/conftest.py)
    sharded, replicated = _final_weights(fsdp_run), _final_weights(torchrun_run)
    assert sharded.keys() == replicated.keys()  # the same Hugging Face folders: evaluation loads them unchanged
    for name, tensor in replicated.items():
        # the same updates; only the order of float additions differs (reduce-scatter, the sharded norm)
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    start = load_file(Path(launch_inputs["policy"]) / "model.safetensors")
    moved = max((sharded[f"policy/{k}"] - v).abs().max().item() for k, v in start.items())
    assert moved > 1e-4  # the updates are far larger than the tolerance above
    rank0, rank1 = _digests(fsdp_run)
    assert rank0 == rank1  # digests of the gathered parameters: both ranks hold shards of the same model
    saved = torch.load(fsdp_run / "state" / "trainer_state.pt", weights_only=True)
    assert saved["sharding"] == "fsdp" and saved["world_size"] == 2 and "policy_opt" not in saved
    assert sorted(p.name for p in (fsdp_run / "state" / "shards").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]


@pytest.mark.slow
@pytest.mark.long
def test_fsdp_resume_from_the_sharded_state_matches_the_uninterrupted_run(fsdp_run, launch_inputs, tmp_path):
    out = tmp_path / "out"
    stopped = _torchrun(launch_inputs, out, "--stop-after", "1", FSDP)
    assert stopped.returncode != 0  # the launcher exits 3; torchrun reports 1
    assert torch.load(out / "state" / "trainer_state.pt", weights_only=True)["step"] == 1, stopped.stderr[-4000:]
    assert not (out / "final").exists()
    # the sharded state cannot be resumed as a replicated one: one sentence, nothing trained
    wrong = _torchrun(launch_inputs, out)
    assert wrong.returncode != 0
    assert "was saved with runtime.sharding=fsdp; resume it with the same setting" in wrong.stderr
    resumed = _torchrun(launch_inputs, out, FSDP)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _digests(out) == _digests(fsdp_run)  # bit for bit: weights, AdamW moments and RNGs all restored
    for name, tensor in _final_weights(fsdp_run).items():
        assert torch.equal(_final_weights(out)[name], tensor), name
