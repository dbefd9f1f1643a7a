"""The pipeline's stages, in the order the flow runs them, each named here once: the Prefect task (tasks/stages.py
and tasks/policy_stages.py), its output folder, the MLflow tag `stage` of its run (which comparisons and studies
look runs up by) and its labels.

No Prefect here (nor anything heavy): benchmarks/overhead_report.py imports this module in its library-alone variant,
whose times must not include Prefect's import.
"""

from __future__ import annotations

from typing import NamedTuple


class Stage(NamedTuple):
    """One stage of the pipeline."""

    task: str  # the Prefect task's name: its output folder `<runtime.output_dir>/<task>/`, the MLflow tag `stage`
    short: str  # the MLflow run's suffix: `<pipeline run name>/<short>` (`pipeline-brave-owl/ppo`)
    label: str  # what the progress artifact and the printed summary call it


# Each stage's names, written here once: the task decorators of tasks/stages.py and tasks/policy_stages.py read them.
PREPARE = Stage("prepare_preferences", "data", "data")
SFT = Stage("supervised_finetune", "sft", "SFT")
WARM_START = Stage("warm_start_policy", "warm", "warm start")
REWARD = Stage("train_reward_model", "reward", "reward model")
ENSEMBLE = Stage("combine_reward_ensemble", "ensemble", "reward ensemble")
INIT = Stage("init_policy_models", "init", "PPO init")
PPO = Stage("train_policy_ppo", "ppo", "PPO")
DPO = Stage("train_policy_dpo", "dpo", "DPO")
EVALUATE = Stage("evaluate_policies", "eval", "evaluation")
STAGES: tuple[Stage, ...] = (PREPARE, SFT, WARM_START, REWARD, ENSEMBLE, INIT, PPO, DPO, EVALUATE)
# The Prefect tag of the stages that compute on the device: a tag concurrency limit on it (`make ui`, `rlhf serve`)
# lets that many of them run at once across all flow runs
GPU_TAG = "gpu"
STAGE_TASKS: tuple[str, ...] = tuple(stage.task for stage in STAGES)
_BY_TASK = {stage.task: stage for stage in STAGES}


def stages_of(
    algorithm: str = "ppo", reward_source: str = "model", ensemble: bool = False, warm_start: bool = False
) -> tuple[Stage, ...]:
    """The stages a pipeline of `algorithm` ('ppo': init and the RL stage; 'dpo': the DPO stage) runs, without the
    reward-model stage where a reward function scores (`reward_source` 'function'), with the ensemble's stage where
    `ensemble` (reward.ensemble_size > 1: its members are reward-model stages), with the warm-start stage where
    `warm_start` (warm_start.enabled)."""
    skipped = {DPO} if algorithm == "ppo" else {INIT, PPO}
    if reward_source == "function":
        skipped.add(REWARD)
    if not ensemble:
        skipped.add(ENSEMBLE)
    if not warm_start:
        skipped.add(WARM_START)
    return tuple(stage for stage in STAGES if stage not in skipped)


def stage_of(task: str) -> Stage:
    """The stage whose Prefect task is named `task`; a name outside the table is its own short name and label."""
    return _BY_TASK.get(task, Stage(task, task, task))
