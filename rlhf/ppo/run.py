"""One run of the policy stage, held once: what it trains on, where it writes, and where it reports.

`train_ppo(run, dist)` takes a `PolicyRun` and the process group; the loop then builds its `ExecutionPlan`
(`rlhf.ppo.plan`: device, dtype, processes, sharding, threads, non-finite handling) and passes the run and the plan
down, in place of a dozen loose arguments. `PolicyInputs` (below) is the serialisable part, built once by the
stage and written as it is for the processes of a data-parallel run; each of them builds the same `PolicyRun` from
it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from rlhf.checkpoints import MANIFEST, atomic_write_text
from rlhf.config import PPOConfig, RewardConfig, RuntimeConfig
from rlhf.data.prepare import gold_scorer
from rlhf.errors import ConfigError
from rlhf.eval.responses import eval_prompts
from rlhf.rollout.rows import PromptRows, RowColumns
from rlhf.tracking.metrics_writer import GoldFn, LogFn

EvalCallback = Callable[[int, dict[str, float]], None]  # (updates done, the periodic evaluation's metrics)


def no_log(metrics: dict[str, float], step: int) -> None:
    """A `log` that records nothing."""


@dataclass
class PolicyRun:
    """The inputs of one run of the policy stage (PPO or a critic-free estimator)."""

    cfg: PPOConfig
    runtime: RuntimeConfig
    policy_path: str  # the SFT checkpoint: the initial policy and the reference
    reward_path: str | None  # the reward model (None: reward.function scores alone)
    prompts: list[str]  # the rollouts' prompt stream
    out_dir: Path | str  # state/, rollouts/, final/
    seed: int
    log: LogFn = no_log  # the logged updates' metrics (rank 0)
    value_path: str | None = None  # the value model's start (None: the reward model)
    gold_fn: GoldFn | None = None  # the data set's gold reward, where it has one
    stop_after: int | None = None  # end after this many updates with the state saved, as a crash would (tests)
    param_digest: bool = False  # several processes: each rank's digest of its final parameters (a test aid)
    eval_prompts: list[str] | None = None  # the held-out prompts of ppo.eval_every's periodic evaluation
    on_eval: EvalCallback | None = None  # called after each periodic evaluation (rank 0); may raise to stop
    reward_cfg: RewardConfig | None = None  # with reward.function: its scores replace or add to the model's
    row_columns: RowColumns | None = None  # data.row_columns of the prompts and held-out prompts, by row key
    prompt_rows: list[str] | None = None  # each prompt's row key (rlhf.rollout.rows), as `prompts`
    eval_rows: list[str] | None = None  # each held-out prompt's row key, as `eval_prompts`
    reward_is_gold: bool = False  # the reward is the data's gold reward itself (a verifier): `RewardConfig.is_the_gold`

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)


def read_prompts(path: str) -> PromptRows:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--prompts: {file} does not exist")
    names = pq.read_schema(file).names
    if "prompt" not in names:
        raise ConfigError(f"--prompts: {file} has no 'prompt' column (columns: {', '.join(names)})")
    return PromptRows.read(file)


def gold_fn_of(manifest_path: str | Path | None):
    """The gold reward of the data set whose manifest.json is at `manifest_path` (None: no gold scores)."""
    if not manifest_path:
        return None

    return gold_scorer(json.loads(Path(manifest_path).read_text()), Path(manifest_path).parent)


def gold_reward_of(manifest_path: str | Path | None) -> str | None:
    """The name of the gold reward (`data.gold_reward`) of the data set whose manifest.json is at `manifest_path`."""
    return json.loads(Path(manifest_path).read_text()).get("gold_reward") if manifest_path else None


@dataclass(frozen=True)
class PolicyInputs:
    """What one run of the policy stage trains on: built once (by `train_policy`'s caller, or from this module's
    options) and written as it is for the processes of a data-parallel run (`write`, `read`: one YAML file)."""

    ppo: PPOConfig
    runtime: RuntimeConfig
    seed: int
    policy_path: str  # the SFT checkpoint: the initial policy and the reference
    reward_path: str | None  # None: reward.function scores alone
    prompts_file: str  # Parquet with a 'prompt' column: the rollouts' prompts
    out_dir: str  # state/, rollouts/, final/ (shared by every process)
    value_path: str | None = None  # the value model's start (None: the reward model)
    reward: RewardConfig | None = None  # reward.function's scores, with or without the reward model
    eval_file: str | None = None  # the held-out split: ppo.eval_every's prompts
    data_manifest: str | None = None  # the prepared data's manifest.json: gold scores where it has them
    stop_after: int | None = None  # end after N updates with the state saved, as a crash would (tests)

    @classmethod
    def prepared(
        cls, ppo: PPOConfig, runtime: RuntimeConfig, seed: int, data_dir: str | Path, **paths: Any
    ) -> PolicyInputs:
        """The inputs of a run on the prepared data in `data_dir` (``rlhf.data.prepare``: prompts.parquet,
        eval.parquet, manifest.json); `paths`: policy_path, reward_path, out_dir and the optional fields."""
        data = Path(data_dir)
        files = {"prompts_file": str(data / "prompts.parquet"), "eval_file": str(data / "eval.parquet")}
        return cls(ppo, runtime, seed, **files, data_manifest=str(data / MANIFEST), **paths)

    def policy_run(self, log: LogFn = no_log, on_eval: EvalCallback | None = None, digests: bool = False) -> PolicyRun:
        """The run these inputs describe, read from their files (prompts, held-out prompts, the gold reward)."""
        evaluated = self.eval_file is not None and self.ppo.eval_every > 0
        prompts = read_prompts(self.prompts_file)
        held = eval_prompts(self.eval_file, self.ppo.eval_n_prompts) if evaluated else None
        return PolicyRun(
            self.ppo, self.runtime, self.policy_path, self.reward_path, prompts.prompts,
            self.out_dir, self.seed, log, value_path=self.value_path or self.reward_path,
            gold_fn=gold_fn_of(self.data_manifest), stop_after=self.stop_after, param_digest=digests,
            eval_prompts=held.prompts if held else None, on_eval=on_eval, reward_cfg=self.reward,
            row_columns=RowColumns.read(self.prompts_file, self.eval_file or ""),
            prompt_rows=prompts.keys, eval_rows=held.keys if held else None,
            reward_is_gold=self.reward is not None and self.reward.is_the_gold(gold_reward_of(self.data_manifest)),
        )  # fmt: skip

    def write(self, path: Path) -> None:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        sections = {k: v.model_dump(mode="json") for k, v in fields.items() if hasattr(v, "model_dump")}
        sections["runtime"]["progress"] = False  # bars do not survive a pipe
        width = {"model_width": self.runtime.model_width}  # not a key of the section: `dtype: auto` is decided at it
        atomic_write_text(path, yaml.safe_dump({**fields, **sections, **width}, sort_keys=False))

    @classmethod
    def read(cls, path: str | Path) -> PolicyInputs:
        raw = yaml.safe_load(Path(path).read_text())
        reward = RewardConfig.model_validate(raw.pop("reward")) if raw.get("reward") else None
        ppo, runtime = PPOConfig.model_validate(raw.pop("ppo")), RuntimeConfig.model_validate(raw.pop("runtime"))
        runtime.with_model_width(raw.pop("model_width", None))
        return cls(ppo, runtime, reward=reward, **{k: v for k, v in raw.items() if k != "reward"})
