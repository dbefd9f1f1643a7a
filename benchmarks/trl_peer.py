"""The peer of `make bench`: TRL 0.19's PPOTrainer on the same docs/benchmark.md shape, timed the same way.

Runs in its own virtual environment (TRL 0.19 needs transformers 4.x): `make bench-peer` creates
`.bench-peer/` and runs this file there. Prints `episodes/s: X`, the median over the updates after the first.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    TrainerCallback,
)
from trl import PPOConfig, PPOTrainer

VOCAB, PROMPT_LEN, RESPONSE_LEN, BATCH = 1000, 16, 32, 64


class UpdateTimer(TrainerCallback):
    """Wall time between consecutive PPO updates (PPOTrainer calls on_step_end once per update)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.marks = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append(time.perf_counter())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1")),
        pad_token="t0",
        eos_token="t2",
    )
    config = GPT2Config(vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=128, n_positions=64, num_labels=1, pad_token_id=0)
    policy = GPT2LMHeadModel(config)
    ref = copy.deepcopy(policy)
    reward = GPT2ForSequenceClassification(config)
    value = GPT2ForSequenceClassification(config)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, VOCAB, (BATCH * args.updates, PROMPT_LEN), generator=gen).tolist()
    dataset = Dataset.from_dict({"input_ids": prompts})
    with tempfile.TemporaryDirectory() as out:
        cfg = PPOConfig(
            # TRL 0.19: rollout batch = per_device_train_batch_size * gradient_accumulation_steps; a minibatch is
            # batch / num_mini_batches and gets one optimizer step (its micro-batch loop runs once here).
            output_dir=out,
            per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=1,
            num_mini_batches=4,
            num_ppo_epochs=4,
            total_episodes=BATCH * args.updates,
            response_length=RESPONSE_LEN,
            temperature=1.0,
            stop_token=None,
            missing_eos_penalty=None,
            local_rollout_forward_batch_size=BATCH,
            report_to=[],
            save_strategy="no",
            num_sample_generations=0,
            use_cpu=True,
            bf16=False,
            fp16=False,
            seed=0,
            logging_steps=1,
            dataloader_num_workers=0,
        )
        trainer = PPOTrainer(
            args=cfg,
            processing_class=tok,
            model=policy,
            ref_model=ref,
            reward_model=reward,
            train_dataset=dataset,
            value_model=value,
        )
        timer = UpdateTimer()
        trainer.add_callback(timer)
        trainer.train()
    durations = [b - a for a, b in zip(timer.marks, timer.marks[1:], strict=False)]
    rates = [BATCH / d for d in durations]
    for i, rate in enumerate(rates, 1):
        print(f"update {i}/{len(rates)}: {rate:.1f} episodes/s")
    print(f"episodes/s: {statistics.median(rates[1:] if len(rates) > 1 else rates):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
