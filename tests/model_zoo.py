"""Tiny random-weight checkpoints of real model families, built offline, with tokenizers that behave like theirs.

Each family is built from a config of its own ``model_type`` (the shapes are tiny, the options are the family's:
OPT's projected embeddings, Gemma-2's logit soft-capping and sliding window, Phi-3's fused projections ...) and a
byte-level BPE tokenizer trained on the synthetic task's text with the family's special tokens, BOS behaviour,
pad token and chat template. Saved with ``save_pretrained`` (model, tokenizer, generation config), so the pipeline
loads them as it would load the hub checkpoints.

    path = build_family("llama", tmp_path)      # a Llama-3-style checkpoint folder
    path = cached_family("gemma2")              # built once per process (tests: the family_checkpoint fixture)
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

from rlhf.data import synthetic

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# SmolLM2-Instruct's: ChatML with a default system prompt when the conversation has none
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST] {{ message['content'] }} "
    "[/INST]{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerStyle:
    """How a family's tokenizer behaves: its special tokens (first in the vocabulary, in this order) and roles."""

    special: tuple[str, ...]
    eos: str
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None
    add_bos: bool = False  # the tokenizer's post-processor puts BOS at the start of every text
    chat_template: str | None = None
    end_of_turn: str | None = None  # the token that closes an assistant turn of the template
    config_eos: tuple[str, ...] = ()  # config.json eos_token_id: one token -> an int, several -> a list
    generation_eos: tuple[str, ...] = ()  # generation_config.json eos_token_id (a list), () -> config's


@dataclass(frozen=True)
class Family:
    model_type: str
    config: dict[str, Any]
    style: TokenizerStyle
    config_pad: int | None = None  # config.json pad_token_id when the family sets one the tokenizer lacks
    extra: dict[str, Any] = field(default_factory=dict)


_SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
_LLAMA3 = TokenizerStyle(
    special=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
    ),
    bos="<|begin_of_text|>",
    eos="<|end_of_text|>",
    add_bos=True,
    chat_template=LLAMA3_TEMPLATE,
    end_of_turn="<|eot_id|>",
    config_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
)
_QWEN = TokenizerStyle(
    special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos=None,
    eos="<|endoftext|>",
    pad="<|endoftext|>",
    chat_template=CHATML_TEMPLATE,
    end_of_turn="<|im_end|>",
    config_eos=("<|endoftext|>",),
    generation_eos=("<|im_end|>", "<|endoftext|>"),
)
_GEMMA = TokenizerStyle(
    special=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    unk="<unk>",
    add_bos=True,
    chat_template=GEMMA_TEMPLATE,
    end_of_turn="<end_of_turn>",
    config_eos=("<eos>",),
    generation_eos=("<eos>", "<end_of_turn>"),
)
_PLAIN = TokenizerStyle(special=("<|endoftext|>",), bos="<|endoftext|>", eos="<|endoftext|>")

SPECS: dict[str, Family] = {
    "llama": Family("llama", dict(_SHAPE), _LLAMA3),
    "qwen2": Family("qwen2", dict(_SHAPE), _QWEN),
    "qwen3": Family("qwen3", {**_SHAPE, "head_dim": 8}, _QWEN),
    "mistral": Family(
        "mistral",
        {**_SHAPE, "sliding_window": None},
        TokenizerStyle(
            special=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
            bos="<s>",
            eos="</s>",
            unk="<unk>",
            add_bos=True,
            chat_template=MISTRAL_TEMPLATE,
            end_of_turn="</s>",
        ),
    ),
    "gemma": Family("gemma", {**_SHAPE, "head_dim": 8}, _GEMMA),
    "gemma2": Family(
        "gemma2",
        {
            **_SHAPE,
            "head_dim": 8,
            "query_pre_attn_scalar": 8,
            "sliding_window": 8,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
        _GEMMA,
    ),
    "gpt_neox": Family(
        "gpt_neox",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25),
        TokenizerStyle(special=("<|endoftext|>", "<|padding|>"), bos="<|endoftext|>", eos="<|endoftext|>"),
        extra={"max_position_embeddings": 256},
    ),
    "opt": Family(  # opt-350m: the decoder works at hidden_size and projects to and from word_embed_proj_dim
        "opt",
        dict(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=16,
            do_layer_norm_before=False,
            dropout=0.1,
            max_position_embeddings=256,
        ),
        TokenizerStyle(special=("<s>", "<pad>", "</s>", "<unk>"), bos="</s>", eos="</s>", unk="<unk>", add_bos=True),
        config_pad=1,
    ),
    "phi": Family(
        "phi",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            partial_rotary_factor=0.5,
            resid_pdrop=0.1,
            max_position_embeddings=256,
        ),
        _PLAIN,
    ),
    "phi3": Family(
        "phi3",
        {**_SHAPE, "original_max_position_embeddings": 256, "resid_pdrop": 0.1},
        TokenizerStyle(
            special=("<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"),
            eos="<|endoftext|>",
            pad="<|endoftext|>",
            chat_template=PHI3_TEMPLATE,
            end_of_turn="<|end|>",
            config_eos=("<|endoftext|>",),
            generation_eos=("<|endoftext|>", "<|end|>"),
        ),
    ),
    "gpt2": Family("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256), _PLAIN),
}
FAMILIES: list[str] = list(SPECS)
CHAT_FAMILIES: list[str] = [name for name, spec in SPECS.items() if spec.style.chat_template]


def corpus(n: int = 300) -> list[str]:
    """Text the tokenizers are trained on: the synthetic task's prompts and responses, and chat role words."""
    texts = [d.prompt + d.response for d in synthetic.demonstrations(n, seed=0)]
    return texts + ["user", "assistant", "model", "system"] * 5


def build_tokenizer(style: TokenizerStyle, vocab_size: int = 500) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the family's special tokens, BOS behaviour, pad token and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(style.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if style.add_bos:
        bos = style.bos
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=style.bos,
        eos_token=style.eos,
        pad_token=style.pad,
        unk_token=style.unk,
        chat_template=style.chat_template,
    )


def _ids(tokenizer: PreTrainedTokenizerFast, tokens: tuple[str, ...]) -> int | list[int] | None:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def build_family(family: str, folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Save a tiny random-weight checkpoint of `family` (model, tokenizer, generation config) in `folder`."""
    spec = SPECS[family]
    style = spec.style
    tokenizer = build_tokenizer(style)
    eos = _ids(tokenizer, style.config_eos or (style.eos,))
    bos = tokenizer.convert_tokens_to_ids(style.bos) if style.bos else None
    pad = tokenizer.pad_token_id if style.pad else spec.config_pad
    config = AutoConfig.for_model(
        spec.model_type,
        vocab_size=len(tokenizer),
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        **spec.config,
        **spec.extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=bos,
        eos_token_id=_ids(tokenizer, style.generation_eos) if style.generation_eos else eos,
        pad_token_id=tokenizer.pad_token_id if style.pad else None,
    )
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="rlhf-model-zoo-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def cached_family(family: str) -> Path:
    """`build_family` once per process, in a temporary folder (read-only use: copy it before changing files)."""
    return build_family(family, _root() / family)


# -- GGUF files (llama.cpp's format) of tiny Llama checkpoints -----------------------------------------------------

# llama.cpp's tensor names: the model's top-level tensors, then each block's (blk.N.<name>.weight)
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_CONTROL, GGUF_NORMAL = 3, 1  # tokenizer.ggml.token_type of special and of ordinary tokens


def _gguf_permute(weight, n_head: int):
    """llama.cpp's permutation of a q/k projection (convert_hf_to_gguf.py): each head's rotary halves interleaved.
    Transformers' GGUF loader undoes it (`LlamaTensorProcessor._reverse_permute_weights`). Shape: (out, in)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(model: Any, tokenizer: PreTrainedTokenizerFast, path: Path, architecture: str = "llama") -> Path:
    """Write a Llama model and its byte-level BPE tokenizer to a GGUF file (F32 tensors, llama.cpp's names and
    metadata), as llama.cpp's converter would. `architecture` is written as general.architecture (another name
    makes a file of an architecture transformers cannot load)."""
    import json

    import gguf
    import numpy as np

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([GGUF_CONTROL if i in special else GGUF_NORMAL for i in range(len(tokens))])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    for name in ("bos", "eos", "pad"):
        token_id = getattr(tokenizer, f"{name}_token_id")
        if token_id is not None:
            getattr(writer, f"add_{name}_token_id")(token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
    for name, tensor in model.state_dict().items():
        weight = tensor.detach().float().numpy()
        if name in _GGUF_TOP:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # a tied head is the embedding: llama.cpp writes no output.weight
            writer.add_tensor(f"{_GGUF_TOP[name]}.weight", np.ascontiguousarray(weight))
            continue
        _, _, layer, *module, _ = name.split(".")  # model.layers.N.<module>.weight
        module = ".".join(module)
        if module == "self_attn.q_proj":
            weight = _gguf_permute(weight, cfg.num_attention_heads)
        elif module == "self_attn.k_proj":
            weight = _gguf_permute(weight, cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{_GGUF_BLOCK[module]}.weight", np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


# SmolLM2's tokenizer: ChatML turns, <|im_start|> its BOS and <|im_end|> its EOS (and end of turn); no BOS added
SMOLLM2_STYLE = TokenizerStyle(
    special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos="<|im_start|>",
    eos="<|im_end|>",
    pad="<|im_end|>",
    chat_template=SMOLLM2_TEMPLATE,
    end_of_turn="<|im_end|>",
)


def build_smollm_like(
    tie_word_embeddings: bool = True, seed: int = 0, **shape: int
) -> tuple[Any, PreTrainedTokenizerFast]:
    """A tiny random-weight Llama (SmolLM2's architecture: tied embeddings, grouped KV heads) and a SmolLM2-like
    tokenizer, float32, in memory; `shape` overrides its sizes (e.g. intermediate_size)."""
    tokenizer = build_tokenizer(SMOLLM2_STYLE)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
        **{**_SHAPE, **shape},
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float().eval(), tokenizer
