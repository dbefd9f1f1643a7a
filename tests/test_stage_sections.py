"""A stage takes its section: the flow hands each stage its own config section and the shared facts it needs
(`flows.pipeline.hand_out`), never the whole PipelineConfig."""

from __future__ import annotations

import inspect

import pytest
from prefect import flow

import tasks.policy_stages
import tasks.stages
from flows.pipeline import hand_out
from rlhf.config import DataConfig, PipelineConfig, RuntimeConfig, SFTConfig, load_config
from rlhf.stages import DPO, EVALUATE, PREPARE
from rlhf.tracking.client import Tracker
from tasks.caching import stage_key
from tasks.outputs import SFTModel
from tasks.tracking import TrackingContext

TASKS = {
    task.name: task
    for module in (tasks.stages, tasks.policy_stages)
    for task in vars(module).values()
    if hasattr(task, "fn")
}
GOLD = "reward.function=rlhf.data.synthetic:gold_reward"


def keys(handed: dict) -> dict[str, list[str]]:
    """Each stage's cache key from what it was handed (an ensemble's members one by one)."""
    by_stage = {task: params if isinstance(params, list) else [params] for task, params in handed.items()}
    return {task: [stage_key(task, member) for member in members] for task, members in by_stage.items()}


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["algorithm=dpo"],
        ["reward.ensemble_size=2", "reward.ensemble_trunks=own_sft"],
        ["reward.source=function", GOLD, "warm_start.enabled=true"],
    ],
)
def test_each_stage_is_handed_what_its_signature_names_and_no_whole_config(overrides):
    handed = hand_out(load_config("conf/smoke.yaml", overrides))
    for task, params in handed.items():
        for member in params if isinstance(params, list) else [params]:
            named = set(inspect.signature(TASKS[task].fn).parameters)
            assert set(member) - {"trunk"} <= named, task
            assert not any(isinstance(value, PipelineConfig) for value in member.values()), task


def test_a_sections_change_reaches_only_the_stages_handed_it():
    base = keys(hand_out(load_config("conf/smoke.yaml", ["algorithm=dpo"])))
    changed = {  # a key of one stage's own section: the other stages' cache keys stay as they were
        EVALUATE.task: keys(hand_out(load_config("conf/smoke.yaml", ["algorithm=dpo", "eval.n_prompts=8"]))),
        DPO.task: keys(hand_out(load_config("conf/smoke.yaml", ["algorithm=dpo", "dpo.beta=0.5"]))),
        PREPARE.task: keys(hand_out(load_config("conf/smoke.yaml", ["algorithm=dpo", "data.split_seed=1"]))),
    }
    for stage, after in changed.items():
        assert [task for task in base if base[task] != after[task]] == [stage]


def test_a_stage_runs_on_its_section_and_the_shared_facts_alone(tmp_path, harness):
    """The data and SFT stages called with their sections, the runtime, the seed and the tracking context; the SFT
    stage's data digest comes with the prepared data."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracking = TrackingContext(uri=uri, experiment="t", parent_run_id=Tracker(uri, "t").start_run("p"))
    runtime = RuntimeConfig(output_dir=str(tmp_path / "out"), progress=False)
    data = DataConfig(source="synthetic", synthetic={"n_sft": 32, "n_train_pairs": 32, "n_eval_pairs": 16})
    sft = SFTConfig(steps=2, batch_size=8, bootstrap={"n_layer": 1, "n_embd": 32, "vocab_size": 320})

    @flow
    def data_and_sft() -> SFTModel:
        prepared = tasks.stages.prepare_preferences(data, "digest", runtime, tracking)
        return tasks.stages.supervised_finetune(sft, prepared, 0, runtime, tracking)

    model = data_and_sft()
    assert model.trained and model.digest and (tmp_path / "out" / "supervised_finetune").is_dir()
