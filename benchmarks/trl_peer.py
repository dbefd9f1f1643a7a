"""The peers of `make bench PEER=1`: TRL's PPOTrainer on the same docs/benchmark.md shape, timed the same way.

Runs with either TRL line, each in its own virtual environment (they need other transformers versions than this
project): TRL 0.19.1 (`trl.PPOTrainer`, transformers 4.5x; `.bench-peer/`) and TRL 1.12.0
(`trl.experimental.ppo.PPOTrainer`, transformers 5.x; `.bench-peer-trl112/`). `make bench PEER=1` creates both
and runs this file in each. The models are built from benchmarks/shapes.py (loaded by its path: the peer venvs
do not have this project installed): random init, the policy and its reference copy, and separate reward and
value `*ForSequenceClassification` models. Prints `episodes/s: X`, the median over the updates after the first.

    .bench-peer/bin/python benchmarks/trl_peer.py --shape cpu-long
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast, TrainerCallback  # noqa: E402

try:  # TRL >= 1.0: PPO lives in trl.experimental (removed in 1.13)
    from trl.experimental.ppo import PPOConfig, PPOTrainer
except ImportError:  # TRL 0.19
    from trl import PPOConfig, PPOTrainer
import trl  # noqa: E402

SHAPES_FILE = Path(__file__).resolve().parent / "shapes.py"


def load_shapes():
    spec = importlib.util.spec_from_file_location("bench_shapes", SHAPES_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class UpdateTimer(TrainerCallback):
    """Wall time between consecutive PPO updates (PPOTrainer calls on_step_end once per update)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.marks = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.marks.append(time.perf_counter())


def main() -> int:
    shapes = load_shapes()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(shapes.SHAPES), default="cpu")
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the shape's, 2)")
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="TRL's bf16 (autocast through accelerate); default: on for GPU shapes, off on a CPU as TRL runs there",
    )
    args = parser.parse_args()
    shape = shapes.SHAPES[args.shape]
    gpu = shape.device == "cuda"
    bf16 = gpu if args.bf16 is None else args.bf16
    if gpu and not torch.cuda.is_available():
        print(shapes.cuda_refusal(args.shape), file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads or shape.threads)
    print(
        f"peer: TRL {trl.__version__} {PPOTrainer.__module__}.PPOTrainer, transformers {transformers.__version__}, "
        f"torch {torch.__version__}; shape={args.shape} threads={torch.get_num_threads()} bf16={bf16}",
        flush=True,
    )
    torch.manual_seed(0)
    vocab = shape.vocab_size
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1")),
        pad_token="t0",
        eos_token="t2",
    )
    config = shapes.model_config(shape)
    lm_class, scalar_class = shapes.model_classes(shape)
    policy = lm_class(config)
    ref = copy.deepcopy(policy)
    reward = scalar_class(config)
    value = scalar_class(config)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (shape.batch_size * args.updates, shape.prompt_len), generator=gen).tolist()
    dataset = Dataset.from_dict({"input_ids": prompts})
    with tempfile.TemporaryDirectory() as out:
        cfg = PPOConfig(
            # rollout batch = per_device_train_batch_size * gradient_accumulation_steps; a minibatch is
            # batch / num_mini_batches and gets one optimizer step (its micro-batch loop runs once here).
            output_dir=out,
            per_device_train_batch_size=shape.batch_size,
            gradient_accumulation_steps=1,
            num_mini_batches=shape.num_mini_batches,
            num_ppo_epochs=shape.num_ppo_epochs,
            total_episodes=shape.batch_size * args.updates,
            response_length=shape.response_len,
            temperature=1.0,
            stop_token=None,
            missing_eos_penalty=None,
            local_rollout_forward_batch_size=shape.batch_size,
            report_to=[],
            save_strategy="no",
            num_sample_generations=0,
            use_cpu=not gpu,
            bf16=bf16,  # TRL 1.x defaults to bf16=True and gradient_checkpointing=True: both set explicitly
            fp16=False,
            gradient_checkpointing=shape.gradient_checkpointing,
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
    rates = [shape.batch_size / d for d in durations]
    for i, rate in enumerate(rates, 1):
        print(f"update {i}/{len(rates)}: {rate:.2f} episodes/s")
    print(f"episodes/s: {statistics.median(rates[1:] if len(rates) > 1 else rates):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
