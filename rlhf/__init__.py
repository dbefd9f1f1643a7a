"""rlhf: RLHF with PPO on Hugging Face causal language models (the library; no Prefect imports)."""

__version__ = "0.1.0"
