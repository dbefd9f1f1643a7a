"""The bootstrap policy: a byte-level BPE tokenizer trained on the task's text and a tiny GPT-2, both offline."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rlhf.models.device import MODEL_BUILD_LOCK

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2 style) on the task's text, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None
    )


def build_tiny_gpt2(
    tokenizer: PreTrainedTokenizerBase, n_layer: int, n_head: int, n_embd: int, n_positions: int, seed: int
) -> GPT2LMHeadModel:
    """A freshly initialised GPT-2 (seeded) over `tokenizer`'s vocabulary."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with MODEL_BUILD_LOCK:
        return GPT2LMHeadModel(config)
