"""The fixed shapes of docs/benchmark.md, one definition for this project and the peers (benchmarks/trl_peer.py).

Imports only torch and transformers (GPT2Config and LlamaConfig exist in transformers 4.5x and 5.x): the peers
load this file by its path in their own virtual environments, without the rest of `rlhf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchShape:
    arch: str  # "gpt2" or "llama"
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    batch_size: int  # prompts (episodes) per update
    prompt_len: int
    response_len: int  # sampled tokens per prompt, no stop-token truncation
    num_mini_batches: int = 4
    num_ppo_epochs: int = 4
    n_kv_head: int | None = None  # llama: grouped-query attention
    intermediate_size: int | None = None  # llama: the MLP width
    device: str = "cpu"  # "cpu": torch.set_num_threads(threads); "cuda": bf16 autocast
    threads: int = 2
    gradient_checkpointing: bool = False

    @property
    def mini_batch_size(self) -> int:
        return self.batch_size // self.num_mini_batches


SHAPES: dict[str, BenchShape] = {
    # 4 layers, 4 heads, hidden 128, vocab 1000; 64 prompts of 16 random ids; 32 sampled tokens; 4 x 4 minibatches
    "cpu": BenchShape("gpt2", 4, 4, 128, 1000, batch_size=64, prompt_len=16, response_len=32),
    # as cpu with a real vocabulary; 32 prompts of 64; 128 sampled tokens; minibatches of 8
    "cpu-long": BenchShape("gpt2", 4, 4, 128, 32000, batch_size=32, prompt_len=64, response_len=128),
    # SmolLM2-135M's layers (Llama: RMSNorm, SwiGLU MLP 1536, RoPE, 9 heads over 3 KV heads, hidden 576, vocab
    # 49152) cut to 4 of its 30 layers, so the peers finish in minutes; 32 prompts of 64, 64 sampled tokens
    "cpu-llama": BenchShape(
        "llama",
        4,
        9,
        576,
        49152,
        batch_size=32,
        prompt_len=64,
        response_len=64,
        n_kv_head=3,
        intermediate_size=1536,
    ),
    # the GPT-2 124M shape, 64 prompts of 16, 64 sampled tokens, GPU bf16
    "gpt2-124m": BenchShape("gpt2", 12, 12, 768, 50257, batch_size=64, prompt_len=16, response_len=64, device="cuda"),
    # the Llama 1.1B shape (22 layers, hidden 2048, 32 heads, 4 KV heads, MLP 5632, vocab 32000), 64 prompts of
    # 128, 256 sampled tokens, GPU bf16, gradient checkpointing
    "llama-1b": BenchShape(
        "llama",
        22,
        32,
        2048,
        32000,
        batch_size=64,
        prompt_len=128,
        response_len=256,
        n_kv_head=4,
        intermediate_size=5632,
        device="cuda",
        gradient_checkpointing=True,
    ),
}


def model_config(shape: BenchShape) -> Any:
    """The transformers config of the policy (and, with num_labels=1, of the reward and value models)."""
    positions = max(64, shape.prompt_len + shape.response_len)
    if shape.arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=shape.vocab_size,
            n_layer=shape.n_layer,
            n_head=shape.n_head,
            n_embd=shape.n_embd,
            n_positions=positions,
            num_labels=1,
            pad_token_id=0,
        )
    if shape.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=shape.vocab_size,
            hidden_size=shape.n_embd,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.n_layer,
            num_attention_heads=shape.n_head,
            num_key_value_heads=shape.n_kv_head or shape.n_head,
            max_position_embeddings=max(2048, positions),
            num_labels=1,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown architecture {shape.arch!r}")


def model_classes(shape: BenchShape) -> tuple[Any, Any]:
    """(causal LM class, sequence-classification class): the policy and reference; the reward and value models."""
    if shape.arch == "gpt2":
        from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

        return GPT2LMHeadModel, GPT2ForSequenceClassification
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    return LlamaForCausalLM, LlamaForSequenceClassification


def cuda_refusal(shape_name: str) -> str:
    """The one sentence with which a GPU shape refuses to run on a machine without CUDA."""
    return f"The {shape_name} shape runs on a CUDA GPU (bf16) and this machine has no CUDA device."
