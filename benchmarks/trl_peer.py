"""The peers of `make bench PEER=1`: TRL's PPOTrainer (or GRPOTrainer) on the same docs/benchmark.md shape, timed
the same way.

Runs with either TRL line, each in its own virtual environment (they need other transformers versions than this
project): TRL 0.19.1 (`trl.PPOTrainer`, transformers 4.5x; `.bench-peer/`) and TRL 1.12.0
(`trl.experimental.ppo.PPOTrainer`, transformers 5.x; `.bench-peer-trl112/`). `make bench PEER=1` creates both
and runs this file in each. The models are built from benchmarks/shapes.py (loaded by its path: the peer venvs
do not have this project installed): random init, the policy and its reference copy, and separate reward and
value `*ForSequenceClassification` models. Prints `episodes/s: X`, the median over the updates after the first.

`--estimator grpo` runs TRL 1.12.0's `trl.GRPOTrainer` instead (the peer of `rlhf bench --estimator grpo`): no value
model; a batch of the shape's batch_size episodes is batch_size / G prompts, each sampled G times
(`--samples-per-prompt`, 4), and one update generates it, scores it with the reward model, and optimises on it
num_ppo_epochs times (TRL's num_iterations) in num_mini_batches minibatches, one AdamW step each.

    .bench-peer/bin/python benchmarks/trl_peer.py --shape cpu-long
    .bench-peer-trl112/bin/python benchmarks/trl_peer.py --shape cpu --estimator grpo
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
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
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
    """Wall time between consecutive updates. PPOTrainer calls on_step_end once per update; GRPOTrainer once per
    optimizer step, `every` (num_mini_batches * num_ppo_epochs) of them an update."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.marks: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.marks = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return
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
        help="TRL's bf16 (autocast through accelerate); default: on for GPU shapes, off on a CPU as TRL runs there "
        "(`rlhf bench --peers` runs each peer both ways on a CPU with native bf16)",
    )
    parser.add_argument(
        "--estimator",
        choices=["ppo", "grpo"],
        default="ppo",
        help="ppo: PPOTrainer (value model, GAE); grpo: TRL 1.12.0's GRPOTrainer (G samples a prompt, no value model)",
    )
    parser.add_argument(
        "--samples-per-prompt",
        type=int,
        default=4,
        help="grpo: G, TRL's num_generations; a batch of the shape's batch_size episodes holds batch_size / G prompts",
    )
    args = parser.parse_args()
    shape = shapes.SHAPES[args.shape]
    gpu = shape.device == "cuda"
    bf16 = gpu if args.bf16 is None else args.bf16
    if gpu and not torch.cuda.is_available():
        print(shapes.cuda_refusal(args.shape), file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads or shape.threads)
    if args.estimator == "grpo":
        return run_grpo(shapes, shape, args, gpu, bf16)
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
    report(timer, shape.batch_size, bf16)
    return 0


def report(timer: UpdateTimer, episodes: int, bf16: bool, seconds: bool = False) -> None:
    """`update i/n (dtype): X episodes/s` for each update and, last, `episodes/s: X`: the median after the first."""
    durations = [b - a for a, b in zip(timer.marks, timer.marks[1:], strict=False)]
    rates = [episodes / d for d in durations]
    dtype = "bfloat16" if bf16 else "float32"
    for i, (rate, duration) in enumerate(zip(rates, durations, strict=True), 1):
        print(f"update {i}/{len(rates)} ({dtype}): {rate:.2f} episodes/s" + (f" ({duration:.2f} s)" if seconds else ""))
    print(f"episodes/s: {statistics.median(rates[1:] if len(rates) > 1 else rates):.2f}")


def grpo_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer of "t0".."t{vocab-1}" (ids 0..vocab-1) split on whitespace, so that TRL's text round trip
    (prompt text -> ids; sampled ids -> completion text -> reward model ids) keeps every token. Its pad and EOS tokens
    have the ids vocab and vocab + 1, which the policy (vocab logits) never samples: TRL stops generation at the
    tokenizer's EOS and masks after it, so no response stops early (every one has max_completion_length tokens, as
    the PPO peer's stop_token=None does it), and decoding with skip_special_tokens drops no sampled token. Nothing is
    padded: every prompt, completion and reward input has the same length."""
    words = {f"t{i}": i for i in range(vocab)} | {"<pad>": vocab, "</s>": vocab + 1}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")


def run_grpo(shapes, shape, args, gpu: bool, bf16: bool) -> int:
    """TRL's GRPOTrainer on the shape: one update generates shape.batch_size episodes (batch_size / G prompts, G
    samples each), scores them with a random-init reward model, and optimises on them num_ppo_epochs times over
    num_mini_batches minibatches (one AdamW step each), with a KL penalty to the reference."""
    try:
        from trl import GRPOConfig, GRPOTrainer
    except (ImportError, RuntimeError) as error:  # TRL's lazy module wraps the ImportError in a RuntimeError
        # trl 1.12.0's grpo_trainer imports its vLLM client, which imports requests, not among trl's dependencies
        print(f"TRL {trl.__version__}'s GRPOTrainer does not import ({error}); pip install requests", file=sys.stderr)
        return 2

    group = args.samples_per_prompt
    if shape.batch_size % group or shape.batch_size % shape.num_mini_batches:
        print(
            f"batch_size {shape.batch_size} must be divisible by --samples-per-prompt {group} and by "
            f"num_mini_batches {shape.num_mini_batches}",
            file=sys.stderr,
        )
        return 2
    prompts_per_update = shape.batch_size // group
    steps_per_update = shape.num_mini_batches * shape.num_ppo_epochs  # optimizer steps
    print(
        f"peer: TRL {trl.__version__} {GRPOTrainer.__module__}.GRPOTrainer, transformers {transformers.__version__}, "
        f"torch {torch.__version__}; shape={args.shape} threads={torch.get_num_threads()} bf16={bf16}",
        flush=True,
    )
    print(
        f"peer grpo: {prompts_per_update} prompts x G={group} = {shape.batch_size} episodes an update, "
        f"{shape.num_ppo_epochs} iterations x {shape.num_mini_batches} minibatches of {shape.mini_batch_size} "
        f"({steps_per_update} optimizer steps), beta=0.04",
        flush=True,
    )
    torch.manual_seed(0)
    vocab = shape.vocab_size
    tok = grpo_tokenizer(vocab)
    lm_class, scalar_class = shapes.model_classes(shape)
    # a config each: TRL sets the reward model's config.pad_token_id and reads the policy's name_or_path
    policy = lm_class(shapes.model_config(shape))
    reward = scalar_class(shapes.model_config(shape))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (prompts_per_update * args.updates, shape.prompt_len), generator=gen).tolist()
    # prompt texts end with a space: TRL scores the text prompt + completion, which must keep the word boundary
    texts = ["".join(f"t{i} " for i in ids) for ids in prompts]
    # TRL 1.12.0's GRPOConfig has no max_prompt_length (removed): the prompts are shape.prompt_len ids by construction
    assert tok(text=texts[:1])["input_ids"] == prompts[:1], "the prompt text does not round-trip to its ids"
    dataset = Dataset.from_dict({"prompt": texts})
    with tempfile.TemporaryDirectory() as out:
        # With beta != 0 GRPOTrainer loads the reference from the policy's name_or_path (from_pretrained): save the
        # random-init policy, so that the reference is its copy, as the PPO peer's deepcopy.
        policy_dir = Path(out) / "policy"
        policy.save_pretrained(policy_dir)
        policy.config._name_or_path = str(policy_dir)
        reward.config._name_or_path = "reward"
        cfg = GRPOConfig(
            output_dir=out,
            # one generation batch = per_device_train_batch_size * steps_per_generation = shape.batch_size episodes,
            # split into steps_per_generation = num_mini_batches minibatches; with gradient_accumulation_steps=1 each
            # minibatch gets one optimizer step, and the batch is reused num_iterations = num_ppo_epochs times before
            # the next generation (TRL's mu): num_mini_batches * num_ppo_epochs optimizer steps an update.
            per_device_train_batch_size=shape.mini_batch_size,
            gradient_accumulation_steps=1,
            steps_per_generation=shape.num_mini_batches,
            num_iterations=shape.num_ppo_epochs,
            num_generations=group,
            max_steps=steps_per_update * args.updates,
            max_completion_length=shape.response_len,  # and no stop (grpo_tokenizer): exactly response_len tokens
            temperature=1.0,
            beta=0.04,  # the GRPO paper's KL coefficient (TRL 1.x defaults to 0.0 and then loads no reference)
            disable_dropout=True,  # as the PPO peer (PPOTrainer disables dropout in all its models) and this project
            report_to=[],
            save_strategy="no",
            use_cpu=not gpu,
            bf16=bf16,  # TRL 1.x defaults to bf16=True and gradient_checkpointing=True: both set explicitly
            fp16=False,
            gradient_checkpointing=shape.gradient_checkpointing,
            seed=0,
            logging_steps=steps_per_update,  # one log an update, as the PPO peer's logging_steps=1
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=reward,
            args=cfg,
            train_dataset=dataset,
            processing_class=tok,
            reward_processing_classes=tok,
        )
        timer = UpdateTimer(every=steps_per_update)
        trainer.add_callback(timer)
        trainer.train()
    report(timer, shape.batch_size, bf16, seconds=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
