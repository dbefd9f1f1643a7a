"""The vLLM generation backend (rlhf/rollout/vllm_backend.py) without a GPU: its settings mapping, weight sync, output
layout and refusals, against a stand-in engine.

`StandInLLM` implements the part of vLLM's Python API the backend calls (``LLM.generate`` on token-id prompts with
one ``SamplingParams`` per prompt, ``LLM.apply_model`` reaching a model's ``load_weights``, ``reset_prefix_cache``,
``sleep`` / ``wake_up``) with a tiny real transformers model loaded from the same checkpoint folder vLLM would load.
Like vLLM's loader it accepts only the checkpoint's tensor names (a wrong name mapping fails), stops at the model's
EOS unless told ``ignore_eos``, and at sleep level 2 discards its weights.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import REPO, seed_prefect_home
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rlhf.config import LoraConfig, load_config
from rlhf.errors import ConfigError
from rlhf.models.loading import load_causal_lm, load_reward_model, load_tokenizer
from rlhf.models.training import apply_lora, unwrap
from rlhf.preflight import preflight
from rlhf.rollout.batching import pad_left
from rlhf.rollout.forwards import policy_forward
from rlhf.rollout.generation import GenerationSettings, Responses, sample_responses
from rlhf.rollout.scoring import ScoringModels, generate_and_score
from rlhf.rollout.vllm_backend import (
    VLLMSampler,
    check_vllm_backend,
    engine_kwargs,
    policy_weights,
    sampling_kwargs,
    start_vllm_sampler,
)

CPU = torch.device("cpu")


@dataclass
class StandInSamplingParams:
    """The fields of vllm.SamplingParams the backend sets, with vLLM's defaults; an unknown name raises TypeError."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    detokenize: bool = True
    logprobs: int | None = None


@dataclass
class Completion:
    token_ids: list[int]


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[Completion]


class StandInModel(torch.nn.Module):
    """vLLM's model in the engine: ``load_weights`` takes (name, tensor) pairs named as in the checkpoint."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
            self.checkpoint_names = set(f.keys())
        self.loaded: list[str] = []

    def load_weights(self, weights) -> set[str]:
        params = dict(self.hf.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            if name not in self.checkpoint_names or name not in params:
                raise KeyError(f"no weight named {name} in the checkpoint")
            params[name].data.copy_(tensor)
            loaded.add(name)
        self.loaded.extend(loaded)
        return loaded


class StandInLLM:
    """The calls of vllm.LLM the backend makes, sampling one request at a time from a transformers model."""

    def __init__(self, folder: Path, seed: int = 0) -> None:
        self.model = StandInModel(folder)
        self.engine_generator = torch.Generator().manual_seed(seed)
        self.requests: list[tuple[list[int], StandInSamplingParams]] = []
        self.prefix_cache_resets = 0
        self.asleep: set[str] = set()

    def apply_model(self, func):
        return [func(self.model)]

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True

    def sleep(self, level: int = 1) -> None:
        if level == 2:  # the weights are discarded: only loading them again makes the model usable
            for param in self.model.parameters():
                param.data.fill_(float("nan"))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.asleep -= set(tags or ("weights", "kv_cache"))

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm=True) -> list[RequestOutput]:
        assert not self.asleep, "generate on a sleeping engine"
        self.generated_with = {n: p.detach().clone() for n, p in self.model.hf.named_parameters()}
        assert len(sampling_params) == len(prompts)
        eos = self.model.hf.config.eos_token_id
        outputs = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            ids = list(prompt["prompt_token_ids"])
            self.requests.append((ids, params))
            rng = torch.Generator().manual_seed(params.seed) if params.seed is not None else self.engine_generator
            completions = []
            for _ in range(params.n):
                out: list[int] = []
                while len(out) < params.max_tokens:
                    logits = self.model.hf(torch.tensor([ids + out])).logits[0, -1].float() / params.temperature
                    if params.top_k > 0:
                        logits[logits < torch.topk(logits, params.top_k).values[-1]] = float("-inf")
                    if params.top_p < 1:
                        sorted_logits, order = logits.sort(descending=True)
                        probs = sorted_logits.softmax(-1)
                        drop = probs.cumsum(-1) - probs > params.top_p
                        logits[order[drop]] = float("-inf")
                    token = int(torch.multinomial(logits.softmax(-1), 1, generator=rng))
                    out.append(token)
                    if token in (params.stop_token_ids or []) or (not params.ignore_eos and token == eos):
                        break
                completions.append(Completion(out))
            outputs.append(RequestOutput(ids, completions))
        return outputs


def _prompts(folder: Path, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, object]:
    tok = load_tokenizer(str(folder))
    ids, mask = pad_left(tok(texts, add_special_tokens=False)["input_ids"], tok.pad_token_id)
    return ids, mask, tok


PROMPTS = ["Review of The Silent River:", "Review of The Paper Horizon, a long one:", "Review of", "Review of"]


# -- settings --------------------------------------------------------------------------------------------------------


def test_sampling_settings_map_to_vllm_parameters():
    settings = GenerationSettings(7, temperature=0.7, top_k=5, top_p=0.9, stop_token_ids=(3, 9), pad_token_id=0)
    assert sampling_kwargs(settings, 123) == {
        "n": 1,
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 0.9,
        "max_tokens": 7,
        "stop_token_ids": [3, 9],
        "ignore_eos": True,  # exactly the configured stop tokens: vLLM adds no EOS of its own
        "seed": 123,
        "detokenize": False,
        "logprobs": None,  # log-probs come from the training model
    }
    plain = sampling_kwargs(GenerationSettings(4), None)
    assert "top_k" not in plain and "top_p" not in plain  # vLLM's defaults: no filtering
    StandInSamplingParams(**plain)  # only names vllm.SamplingParams has


def test_engine_settings_follow_the_config(tiny_checkpoints):
    config = load_config(None, ["ppo.generation.gpu_memory_utilization=0.25", "ppo.generation.sleep=true"])
    kwargs = engine_kwargs(config.ppo, config.runtime, tiny_checkpoints["policy"], 7, torch.bfloat16)
    assert kwargs["model"] == tiny_checkpoints["policy"]
    assert kwargs["dtype"] == "bfloat16"
    assert kwargs["gpu_memory_utilization"] == 0.25
    assert kwargs["enable_sleep_mode"] is True
    assert kwargs["max_model_len"] == config.ppo.max_prompt_tokens + config.ppo.max_new_tokens
    assert kwargs["seed"] == 7 and kwargs["skip_tokenizer_init"] is True


def test_each_prompt_gets_a_seed_from_the_run_generator(family_checkpoint):
    folder = family_checkpoint("gpt2")
    ids, mask, tok = _prompts(folder, PROMPTS)
    settings = GenerationSettings(6, temperature=1.0, stop_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    policy = load_causal_lm(str(folder), CPU)
    runs = []
    for _ in range(2):
        engine = StandInLLM(folder)
        sampler = VLLMSampler(engine, policy, StandInSamplingParams)
        resp = sampler(ids, mask, settings, torch.Generator().manual_seed(5))
        runs.append((resp, [params.seed for _, params in engine.requests]))
        assert [params.n for _, params in engine.requests] == [1] * len(PROMPTS)
        assert [prompt for prompt, _ in engine.requests] == [
            row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)
        ]
    (first, seeds), (second, seeds_again) = runs
    assert seeds == seeds_again and len(set(seeds)) == len(seeds)  # the two identical prompts are sampled apart
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.mask, second.mask)

    engine = StandInLLM(folder)
    VLLMSampler(engine, policy, StandInSamplingParams, seed_requests=False)(ids, mask, settings, None)
    assert all(params.seed is None for _, params in engine.requests)


# -- output layout ---------------------------------------------------------------------------------------------------


def _assert_same(a: Responses, b: Responses) -> None:
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.mask.tolist() == b.mask.tolist()
    assert a.contains_stop.tolist() == b.contains_stop.tolist()
    assert a.tokens.dtype == b.tokens.dtype and a.mask.dtype == b.mask.dtype


def test_responses_have_the_builtin_samplers_layout(family_checkpoint):
    # greedy (top_k=1): both samplers draw the same tokens, so every difference is one of layout
    folder = family_checkpoint("gpt2")
    ids, mask, tok = _prompts(folder, PROMPTS[:3])
    policy = load_causal_lm(str(folder), CPU).eval()
    sampler = VLLMSampler(StandInLLM(folder), policy, StandInSamplingParams)

    def both(stops: tuple[int, ...]) -> Responses:
        settings = GenerationSettings(8, top_k=1, stop_token_ids=stops, pad_token_id=tok.pad_token_id)
        builtin = sample_responses(policy, ids, mask, settings)
        _assert_same(sampler(ids, mask, settings, torch.Generator()), builtin)
        return builtin

    free = both(())  # no stop token: every row runs to max_new_tokens
    assert free.tokens.shape == (3, 8) and bool(free.mask.all())
    # a stop token some rows reach: those are cut after it and padded (with the pad id, EOS here), the rest run on
    some = both((int(free.tokens[0, 2]),))
    assert bool(some.contains_stop[0]) and not bool(some.contains_stop.all())
    # every row stops within two tokens: the batch is as wide as its longest response
    early = both(tuple(int(t) for t in free.tokens[:, 1]))
    assert bool(early.contains_stop.all()) and early.tokens.shape[1] <= 2


def test_log_probs_still_come_from_the_training_model(tiny_checkpoints):
    folder = Path(tiny_checkpoints["policy"])
    ids, mask, tok = _prompts(folder, PROMPTS)
    policy = load_causal_lm(str(folder), CPU).eval()
    models = ScoringModels(
        policy=policy,
        reference=load_causal_lm(str(folder), CPU).eval(),
        reward=load_reward_model(tiny_checkpoints["reward"], CPU).eval(),
        tokenizer=tok,
        reward_tokenizer=tok,
        same_tokenizer=True,
        sampler=VLLMSampler(StandInLLM(folder), policy, StandInSamplingParams),
    )
    settings = GenerationSettings(6, temperature=0.7, stop_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    scored = generate_and_score(models, ids, mask, None, settings, torch.Generator().manual_seed(1), torch.float32)
    with torch.no_grad():
        expected = policy_forward(policy, scored.query_responses, scored.qr_mask, ids.shape[1], 0.7).logprobs
    assert torch.allclose(scored.logprobs, expected)
    assert scored.logprobs.shape == scored.resp.tokens.shape


# -- weight sync -----------------------------------------------------------------------------------------------------


def _train_one_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    out = model(input_ids=ids, attention_mask=mask)
    out.logits.float().logsumexp(-1).mean().backward()
    optimizer.step()


def _engine_params(engine: StandInLLM) -> dict[str, torch.Tensor]:
    return dict(engine.model.hf.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pushed_weights_equal_the_policys_after_an_update(family, family_checkpoint):
    folder = family_checkpoint(family)
    ids, mask, _ = _prompts(folder, PROMPTS)
    policy = load_causal_lm(str(folder), CPU)
    engine = StandInLLM(folder)
    sampler = VLLMSampler(engine, policy, StandInSamplingParams)
    _train_one_step(policy, ids, mask)
    policy_params = dict(policy.named_parameters(remove_duplicate=False))
    assert set(policy_params) == set(_engine_params(engine))
    assert not all(torch.equal(p, _engine_params(engine)[n]) for n, p in policy_params.items())  # it did change

    assert sampler.sync_weights() >= 0
    for name, param in policy_params.items():  # lm_head included: tied to the embeddings in GPT-2, not in Llama
        assert torch.equal(_engine_params(engine)[name], param), name
    tied = policy.config.tie_word_embeddings
    assert tied == (family == "gpt2")
    embeddings = _engine_params(engine)[next(n for n in policy_params if "embed" in n or "wte" in n)]
    assert (engine.model.hf.lm_head.weight.data_ptr() == embeddings.data_ptr()) == tied
    assert set(engine.model.loaded) == {n for n in policy_params if not (tied and n == "lm_head.weight")}
    assert engine.prefix_cache_resets == 1  # prompt states cached with the old weights are dropped


def test_a_lora_policy_is_pushed_merged(family_checkpoint):
    folder = family_checkpoint("gpt2")
    ids, mask, _ = _prompts(folder, PROMPTS)
    policy = apply_lora(load_causal_lm(str(folder), CPU), LoraConfig(enabled=True, r=4, alpha=8))
    base_before = {n: p.detach().clone() for n, p in unwrap(policy).named_parameters() if ".base_layer." in n}
    _train_one_step(policy, ids, mask)
    engine = StandInLLM(folder)
    VLLMSampler(engine, policy, StandInSamplingParams).sync_weights()

    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    assert set(n for n, _ in policy_weights(policy)) == set(merged)
    for name, param in merged.items():
        assert torch.allclose(_engine_params(engine)[name], param, atol=1e-6), name
    adapted = [n for n in merged if n.endswith("c_attn.weight")]
    original = load_causal_lm(str(folder), CPU).state_dict()
    assert adapted and not any(torch.allclose(merged[n], original[n]) for n in adapted)  # the adapters count
    for name, before in base_before.items():  # the policy keeps its unmerged base weights
        assert torch.equal(dict(unwrap(policy).named_parameters())[name], before)


def test_sleep_mode_reloads_the_policys_weights_before_generating(family_checkpoint):
    folder = family_checkpoint("gpt2")
    ids, mask, tok = _prompts(folder, PROMPTS)
    policy = load_causal_lm(str(folder), CPU)
    engine = StandInLLM(folder)
    sampler = VLLMSampler(engine, policy, StandInSamplingParams, sleep=True)
    settings = GenerationSettings(5, stop_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    sampler(ids, mask, settings, torch.Generator().manual_seed(0))
    assert sampler.asleep and engine.asleep  # released after generating
    _train_one_step(policy, ids, mask)
    assert sampler.sync_weights() == 0.0  # nothing to push into a sleeping engine: done when it wakes
    sampler(ids, mask, settings, torch.Generator().manual_seed(0))
    for name, param in policy.named_parameters():  # it woke with the updated policy's weights
        assert torch.equal(engine.generated_with[name], param), name
    assert sampler.asleep and engine.asleep


# -- refusals ----------------------------------------------------------------------------------------------------------


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of machines without CUDA")


@NO_CUDA
def test_vllm_is_refused_without_cuda_in_one_sentence():
    with pytest.raises(ConfigError, match=r"^ppo\.generation\.backend=vllm needs a CUDA GPU and this machine has none"):
        preflight(load_config(None, ["ppo.generation.backend=vllm"]))
    preflight(load_config(None, []))  # the default backend passes
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):  # the library path refuses the same way
        start_vllm_sampler(
            load_config(None, []).ppo,
            load_config(None, []).runtime,
            "unused",
            torch.nn.Linear(1, 1),
            CPU,
            0,
            torch.float32,
        )


def test_vllm_refusals_on_a_gpu_machine_name_the_key():
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        check_vllm_backend("cuda", "cuda:1")
    with pytest.raises(ConfigError, match="runtime.ppo_processes=1"):
        check_vllm_backend("cuda", "cuda", processes=2)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match=r"pip install -e '\.\[vllm\]'"):
            check_vllm_backend("cuda", "cuda")


@NO_CUDA
def test_the_terminal_shows_one_sentence_and_exit_code_2(tmp_path):
    env = {**os.environ, "PREFECT_HOME": seed_prefect_home(tmp_path / "prefect")}
    args = [sys.executable, "-m", "flows.pipeline", "--config", "conf/smoke.yaml", "ppo.generation.backend=vllm"]
    args += [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"runtime.output_dir={tmp_path}/out"]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: ppo.generation.backend=vllm needs a CUDA GPU and this machine has none; "
        "use ppo.generation.backend=builtin"
    ], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
