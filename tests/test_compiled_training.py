"""runtime.compile_training (rlhf/models/compiled.py): the PPO stage's training forwards under torch.compile give
eager's log-probs and gradients, compile once for every micro-batch shape, leave no-grad forwards eager and the
checkpoint untouched, fall back to eager with a warning where the compile fails, and train a PPO run end to end."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch._dynamo.utils import counters

from rlhf.config import PPOConfig, RuntimeConfig
from rlhf.data import synthetic
from rlhf.errors import ConfigError
from rlhf.models.bootstrap import build_tiny_gpt2, build_tokenizer
from rlhf.models.compiled import COMPILE_FAILURES, compile_for_training
from rlhf.models.cpu_kernels import use_cpu_kernels
from rlhf.models.training import disable_dropout
from rlhf.ppo.distributed import check_sharding
from rlhf.ppo.run import PolicyRun
from rlhf.ppo.trainer import train_ppo
from rlhf.rollout.forwards import policy_forward

RUNTIME = RuntimeConfig(device="cpu", progress=False, dtype="float32")  # float32 numerics: the tolerances below


def _policy(seed: int = 0):
    texts = [d.prompt + d.response for d in synthetic.demonstrations(50, seed=0)]
    model = build_tiny_gpt2(
        build_tokenizer(texts, vocab_size=200), n_layer=2, n_head=2, n_embd=32, n_positions=64, seed=seed
    )
    disable_dropout(model)
    use_cpu_kernels(model)  # as the PPO stage's models run on a CPU
    return model.train()


def _batch(rows: int, length: int, prompt_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 200, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[: rows // 2, :2] = 0  # left padding in half of the rows
    return ids, mask, prompt_len


def _step(model, ids, mask, prompt_len):
    """A micro-batch's training forward and backward: the log-probs and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    out = policy_forward(model, ids, mask, prompt_len, 0.8, with_entropy=True, entropy_grad=True)
    (out.logprobs.mean() - 0.01 * out.entropy.mean()).backward()
    return out.logprobs.detach(), [p.grad.clone() for p in model.parameters()]


class CountingBackend:
    """A torch.compile backend that runs the captured graph as it is, counting the graphs it is given and the calls
    of the compiled code."""

    def __init__(self) -> None:
        self.graphs = self.calls = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


def test_a_compiled_backbone_trains_as_eager_with_one_graph_for_every_shape(tmp_path):
    eager, compiled = _policy(), _policy()
    backend = CountingBackend()
    compile_for_training(compiled, backend=backend)
    for rows, length, prompt_len in ((8, 24, 8), (8, 19, 6), (5, 30, 10)):  # widths and rows as micro-batches vary
        batch = _batch(rows, length, prompt_len, seed=length)
        logprobs, grads = _step(compiled, *batch)
        want_logprobs, want_grads = _step(eager, *batch)
        torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-5)
        for got, want in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert backend.graphs == 1  # the rows and the length are dynamic: one compile serves every shape
    assert backend.calls >= 3
    calls = backend.calls
    with torch.no_grad():  # scoring and evaluation: the eager backbone, bit for bit
        ids, mask, p = _batch(4, 20, 8, seed=1)
        assert torch.equal(
            policy_forward(compiled, ids, mask, p, 1.0).logprobs, policy_forward(eager, ids, mask, p, 1.0).logprobs
        )
    assert backend.graphs == 1 and backend.calls == calls
    assert list(compiled.state_dict()) == list(eager.state_dict())  # the compiled module is not a submodule
    compiled.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors"]
    )


def test_a_failed_compile_warns_once_and_trains_eager(caplog):
    calls = []

    def no_compiler(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("no C++ compiler found")

    eager, compiled = _policy(), _policy()
    compile_for_training(compiled, backend=no_compiler)
    failures = len(COMPILE_FAILURES.reasons)
    with caplog.at_level(logging.WARNING, logger="rlhf.models.compiled"):
        for seed in (0, 1):
            batch = _batch(4, 16, 6, seed=seed)
            logprobs, grads = _step(compiled, *batch)
            want_logprobs, want_grads = _step(eager, *batch)
            assert torch.equal(logprobs, want_logprobs)
            assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))
    assert len(calls) == 1  # not tried again
    assert len(COMPILE_FAILURES.reasons) == failures + 1 and "no C++ compiler found" in COMPILE_FAILURES.reasons[-1]
    warnings = [r.getMessage() for r in caplog.records if "trains eager" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler found" in warnings[0]


def test_compile_training_is_refused_with_fsdp():
    runtime = RUNTIME.model_copy(update={"compile_training": True, "sharding": "fsdp"})
    with pytest.raises(ConfigError, match=r"runtime.sharding 'fsdp' does not work with runtime.compile_training"):
        check_sharding(PPOConfig(), runtime, world_size=2)


@pytest.mark.slow  # inductor compiles two models: about a minute on 2 cores, cold
def test_a_ppo_run_with_compile_training_logs_eager_figures(tiny_checkpoints, tmp_path):
    """A PPO run (the policy and the value model compiled, side by side in two threads where the CPU has two cores)
    with inductor, the compiler users get, against the same run eager: the same statistics, no failure."""
    prompts = sorted({d.prompt for d in synthetic.demonstrations(60, seed=0)})
    cfg = PPOConfig(
        total_episodes=16, batch_size=8, num_mini_batches=2, num_ppo_epochs=2, max_new_tokens=8, save_every=100,
        record_rollouts=False,
    )  # fmt: skip
    failures, graphs = len(COMPILE_FAILURES.reasons), counters["stats"]["unique_graphs"]
    logged: dict[bool, dict[int, dict[str, float]]] = {}
    for compile_training in (False, True):
        runtime = RUNTIME.model_copy(update={"compile_training": compile_training})
        log = logged.setdefault(compile_training, {})
        result = train_ppo(
            PolicyRun(
                cfg, runtime, tiny_checkpoints["policy"], tiny_checkpoints["reward"], prompts,
                tmp_path / str(compile_training), 0, lambda m, s, log=log: log.__setitem__(s, m),
            )
        )  # fmt: skip
        assert result.updates == 2
    for step in (1, 2):
        for key in (
            "policy/loss",
            "policy/approxkl",
            "policy/entropy",
            "objective/kl",
            "value/loss",
            "objective/scores",
        ):
            want = logged[False][step][key]
            assert math.isclose(logged[True][step][key], want, rel_tol=1e-3, abs_tol=1e-5), (step, key)
    assert len(COMPILE_FAILURES.reasons) == failures
    assert counters["stats"]["unique_graphs"] > graphs  # inductor compiled them
