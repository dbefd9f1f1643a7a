"""Building, loading and adapting the transformers models of every stage.

``device`` (device and dtype choice, autocast), ``loading`` (tokenizers, causal LMs, reward models from a path or
hub id), ``bootstrap`` (the tiny GPT-2 and its tokenizer), ``heads`` (LM and scalar heads on backbone hidden
states), ``training`` (what a trained model needs: fused GELU, AdamW, gradient checkpointing, no dropout, LoRA),
``stop_tokens`` (the ids that end a response) and ``sharding`` (FSDP2 across processes). Import from the
module, not from this package.
"""
