"""Gold-free signals checked on the training rollouts a PPO stage records (rollouts/update_*.parquet, with their
gold): each run's responses re-scored by models the run never optimised, and how well each score tells the runs
whose gold falls from the rest (docs/overoptimisation.md, "Signals tried and dropped").

- **A monitor**: a reward model, or an ensemble's members, held out of the policy's objective (e.g. members of
  their own pretraining, `reward.ensemble_trunks: own_sft`). Each member's score is standardised by its mean and
  std on the run's held-out preference pairs; the signal is how far the members' mean falls below its best so
  far. A monitor sees what the data taught it: if every reward model trained on the data shares a flaw, so does
  the monitor.
- **The SFT model's surprisal per token** of the responses: its mean (what `periodic_eval/ref_surprisal` measures
  at the evaluations) and its tail, the share of response tokens over `TAIL_NATS` nats, each as its rise over the
  first recorded update's.

    python -m rlhf.sweeps.rollout_rescore --experiment rlhf-ppo --monitor outputs/combine_reward_ensemble/NAME
        [--filter NAME] [--every 5] [--out rows.csv]

The texts are tokenized again (the rollouts keep text, not ids), so a response's tokens can differ from the
sampled ones where a tokenizer does not round-trip.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.loading import load_causal_lm, load_reward_model, load_tokenizer
from rlhf.models.reward_ensemble import member_paths
from rlhf.ops import logprobs_from_logits
from rlhf.rollout.batching import encode_prompt_response
from rlhf.sweeps.alarm_check import alarm_table
from rlhf.sweeps.alarm_signals import separation_table
from rlhf.tracking.client import Tracker
from rlhf.train.reward import score_texts

TAIL_NATS = 5.0  # a response token the SFT model gives under e^-5 (about 0.7%) counts in the tail
MAX_LENGTH = 128  # tokens of prompt + response scored (reward.max_length's default)
BATCH = 64


@torch.no_grad()
def token_surprisal(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], responses: list[str]
) -> list[Tensor]:
    """-log p(token) under `model` of each response's tokens after its prompt, one tensor per response (empty for
    an empty response). Shape: [(len_i,), ...]."""
    out: list[Tensor] = []
    for start in range(0, len(prompts), BATCH):
        batch = encode_prompt_response(
            tokenizer, prompts[start : start + BATCH], responses[start : start + BATCH], MAX_LENGTH, add_eos=False
        )
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        nll = -logprobs_from_logits(logits, batch.input_ids[:, 1:])
        mask = batch.loss_mask[:, 1:].bool()
        out += [row[keep] for row, keep in zip(nll.float(), mask, strict=True)]
    return out


@dataclass
class Monitor:
    """Reward models scoring texts, each member standardised on held-out preference pairs."""

    members: list[tuple[PreTrainedModel, PreTrainedTokenizerBase]]
    means: Tensor  # (K,)
    stds: Tensor  # (K,)

    @classmethod
    def load(cls, path: str, eval_pairs: pd.DataFrame) -> Monitor:
        """The reward model or ensemble at `path`, standardised on the chosen and rejected responses of
        `eval_pairs` (prompt, chosen, rejected)."""
        cpu = torch.device("cpu")
        members = [(load_reward_model(p, cpu).eval(), load_tokenizer(p)) for p in member_paths(path)]
        monitor = cls(members, torch.zeros(len(members)), torch.ones(len(members)))
        prompts = eval_pairs["prompt"].tolist() * 2
        raw = monitor.raw_scores(prompts, eval_pairs["chosen"].tolist() + eval_pairs["rejected"].tolist())
        monitor.means, monitor.stds = raw.mean(1), raw.std(1)
        return monitor

    @torch.no_grad()
    def raw_scores(self, prompts: list[str], responses: list[str]) -> Tensor:
        """Each member's scores. Shape: (K, n)."""
        cpu, chunks = torch.device("cpu"), range(0, len(prompts), BATCH)
        rows = [
            torch.cat(
                [
                    score_texts(model, tokenizer, prompts[i : i + BATCH], responses[i : i + BATCH], MAX_LENGTH, cpu)
                    for i in chunks
                ]
            ).float()
            for model, tokenizer in self.members
        ]
        return torch.stack(rows)

    def scores(self, prompts: list[str], responses: list[str]) -> Tensor:
        """The members' standardised scores. Shape: (K, n)."""
        return (self.raw_scores(prompts, responses) - self.means[:, None]) / self.stds[:, None]


def rollout_files(out_dir: str | Path, every: int) -> list[tuple[int, Path]]:
    """(update, file) of a PPO stage's recorded rollouts: the first update's and every `every`-th."""
    files = sorted(Path(out_dir, "rollouts").glob("update_*.parquet"))
    updates = [(int(f.stem.removeprefix("update_")), f) for f in files]
    return [(u, f) for u, f in updates if u == 1 or u % every == 0]


def rescore_rollouts(
    files: list[tuple[int, Path]], sft: tuple[PreTrainedModel, PreTrainedTokenizerBase], monitor: Monitor | None
) -> pd.DataFrame:
    """One row per recorded update: its gold and score (means over the rollout), the SFT model's surprisal (mean
    over tokens, and the share of tokens over TAIL_NATS) and the monitor's standardised score (mean over members and
    responses)."""
    rows = []
    for update, file in files:
        frame = pd.read_parquet(file)
        prompts, responses = frame["prompt"].tolist(), frame["response"].tolist()
        nll = torch.cat(token_surprisal(*sft, prompts, responses) or [torch.zeros(0)])
        row = {"update": update, "gold": frame["gold_score"].mean(), "score": frame["score"].mean()}
        row["surprisal"] = nll.mean().item() if len(nll) else float("nan")
        row["surprisal_tail"] = (nll > TAIL_NATS).float().mean().item() if len(nll) else float("nan")
        if monitor is not None:
            row["monitor"] = monitor.scores(prompts, responses).mean().item()
        rows.append(row)
    return pd.DataFrame(rows)


def run_signals(updates: pd.DataFrame) -> dict[str, float]:
    """One run's signals from its rescored updates (`rescore_rollouts`): the surprisal's and the tail's largest rise
    over the first update's, and the monitor's largest fall below its best so far."""
    first = updates.iloc[0]
    signals = {
        "signal: rollout surprisal (rise)": float((updates["surprisal"] - first["surprisal"]).max()),
        "signal: rollout surprisal tail (rise)": float((updates["surprisal_tail"] - first["surprisal_tail"]).max()),
    }
    if "monitor" in updates:
        fall = updates["monitor"].cummax() - updates["monitor"]
        signals["signal: monitor (fall from its best)"] = float(fall.max())
    return signals


def rescore_table(
    tracker: Tracker, experiment: str, monitor_path: str | None, name_filter: str = "", every: int = 5
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The runs of `alarm_check.alarm_table` that recorded their rollouts, with the signals of `run_signals` added;
    and every rescored update (column run)."""
    table = alarm_table(tracker, experiment, name_filter)
    stage_runs = {r.name: r for r in tracker.search_runs("tags.stage = 'train_policy_ppo'")}
    sft_models: dict[str, tuple[PreTrainedModel, PreTrainedTokenizerBase]] = {}
    monitors: dict[str, Monitor] = {}
    rows, updates = [], []
    for _, row in table.iterrows():
        stage = stage_runs[row["run"]]
        files = rollout_files(stage.tags.get("output_dir", ""), every)
        parent = tracker.get_run(stage.parent_run_id).data.tags if stage.parent_run_id else {}
        if not files or "sft_checkpoint" not in parent:
            continue
        sft = parent["sft_checkpoint"]
        if sft not in sft_models:
            sft_models[sft] = (load_causal_lm(sft, torch.device("cpu")).eval(), load_tokenizer(sft))
        monitor = None
        if monitor_path is not None:
            data = parent["data"]
            if data not in monitors:
                monitors[data] = Monitor.load(monitor_path, pd.read_parquet(Path(data, "eval.parquet")))
            monitor = monitors[data]
        rescored = rescore_rollouts(files, sft_models[sft], monitor)
        updates.append(rescored.assign(run=row["run"]))
        rows.append({**row.to_dict(), **run_signals(rescored)})
    return pd.DataFrame(rows), pd.concat(updates, ignore_index=True) if updates else pd.DataFrame()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    parser.add_argument("--experiment", action="append", help="an experiment to read (repeat for several)")
    parser.add_argument("--filter", default="", help="only runs whose name contains this")
    parser.add_argument("--monitor", help="a reward model or ensemble folder the runs' policies were not trained on")
    parser.add_argument("--every", type=int, default=5, help="rescore every this many updates (and the first)")
    parser.add_argument("--out", help="also write every rescored update to this CSV file")
    args = parser.parse_args(argv)
    tables, updates = [], []
    for name in args.experiment or ["rlhf-ppo"]:
        table, rescored = rescore_table(Tracker(args.tracking_uri, name), name, args.monitor, args.filter, args.every)
        tables.append(table)
        updates.append(rescored)
    table = pd.concat([t for t in tables if not t.empty] or [pd.DataFrame()], ignore_index=True)
    if table.empty:
        print("no PPO run with periodic evaluations, a gold reward and recorded rollouts")
        return
    falls = table["falls"].astype(bool)
    print(f"{len(table)} runs with recorded rollouts: {int(falls.sum())} whose gold falls, {int((~falls).sum())} not")
    with pd.option_context("display.width", 200):
        print(separation_table(table).round(3).to_string(index=False))
    if args.out:
        pd.concat(updates, ignore_index=True).to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
