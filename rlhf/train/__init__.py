"""The supervised trainers: the shared loop (`supervised`), SFT (`sft`), the reward model (`reward`) and the verified
best-of-N warm start (`warm_start`: SFT on the policy's own samples that a reward function passes)."""
