"""The supervised trainers: the shared loop (`supervised`), SFT (`sft`) and the reward model (`reward`)."""
