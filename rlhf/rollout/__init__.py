"""Sampling and scoring responses: generation (`generation`, the vLLM backend `vllm_backend`), scoring by the policy,
reference, value and reward models (`scoring`), tokenising and batching (`batching`, `tokens`)."""
