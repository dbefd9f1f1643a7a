"""The token ids that end a response: EOS ids of the tokenizer and configs, the chat template's end-of-turn token,
and configured stop tokens."""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from rlhf.errors import ConfigError
from rlhf.models.loading import load_tokenizer, token_ids


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """Whether two tokenizers map the same tokens to the same ids (then token ids can be shared between models)."""
    return a.get_vocab() == b.get_vocab()


# Tokens that close an assistant turn in common chat templates (a fallback when rendering the template fails).
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "</s>")
_PROBE = "Zq7Xv"  # an assistant message the probe conversation renders, to find what follows it


def added_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids of the tokenizer's special and added tokens (BOS, EOS, pad, chat-template markers ...)."""
    return set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token that closes an assistant turn of the tokenizer's chat template; None without a template.

    Found by rendering a one-exchange conversation and taking the first special (added) token after the
    assistant's message; a template that cannot render it falls back to well-known end-of-turn tokens.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    special = added_ids(tokenizer)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # any template error (jinja, raise_exception): fall back to the known names
        text = ""
    if _PROBE in text:
        after = text.split(_PROBE, 1)[1]
        found = [i for i in tokenizer(after, add_special_tokens=False)["input_ids"] if i in special]
        if found:
            return found[0]
    vocab = tokenizer.get_vocab()
    return next((vocab[t] for t in END_OF_TURN_TOKENS if vocab.get(t) in special), None)


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    stop_tokens: list[int | str],
    config: Any = None,
    generation_config: Any = None,
) -> tuple[int, ...]:
    """Ids that end a response: the tokenizer's EOS, every EOS id of the generation config and of the model config
    (an int or a list), the chat template's end-of-turn token, and the configured `stop_tokens` (a string must be
    exactly one token of the policy's vocabulary)."""
    eos_fields = (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None))
    eos_fields += (getattr(config, "eos_token_id", None), end_of_turn_id(tokenizer))
    ids = [i for field in eos_fields for i in token_ids(field)]
    for tok in stop_tokens:
        if isinstance(tok, int):
            ids.append(tok)
            continue
        encoded = tokenizer(tok, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ConfigError(f"ppo.stop_tokens: '{tok}' is {len(encoded)} tokens for this tokenizer, not one")
        ids.append(encoded[0])
    return tuple(dict.fromkeys(ids))


def checkpoint_stop_tokens(path: str, stop_tokens: list[int | str], trust_remote_code: bool) -> dict[int, str]:
    """`stop_token_ids` of a saved policy (its tokenizer, config and generation config, not its weights), each
    with its token."""
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the model config's EOS ids stand
        generation_config = None
    ids = stop_token_ids(tokenizer, stop_tokens, config, generation_config)
    return dict(zip(ids, tokenizer.convert_ids_to_tokens(list(ids)), strict=True))
