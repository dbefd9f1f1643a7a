"""The task layer's caching contract: the code version covers tasks/, a stage's folder is named by the key its
task is cached on, and the typed stage outputs survive Prefect's JSON result serializer."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from prefect.exceptions import TerminationSignal

from rlhf.config import load_config
from rlhf.data.lengths import LengthLimits
from tasks import caching
from tasks.outputs import Evaluation, PolicyInit, PPOPolicy, PreparedData, RewardModel, SFTModel, StageOutput
from tasks.tracking import TrackingContext
from tests.conftest import REPO


def test_the_code_version_covers_the_library_and_the_task_layer(tmp_path):
    assert {path.name for path in caching.CODE_PACKAGES} == {"rlhf", "tasks"}
    assert caching.code_version() == caching.source_digest(*caching.CODE_PACKAGES)
    copies = [tmp_path / name for name in ("rlhf", "tasks")]
    for copy in copies:
        shutil.copytree(REPO / copy.name, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = caching.source_digest(*copies)
    assert before == caching.code_version()  # the same files give the same version wherever they are
    (tmp_path / "tasks" / "README.txt").write_text("not code")
    assert caching.source_digest(*copies) == before
    stages = tmp_path / "tasks" / "stages.py"
    stages.write_text(stages.read_text() + "\n# a change in a task body\n")
    assert caching.source_digest(*copies) != before


def _parameters(tmp_path: Path) -> dict:
    config = load_config(REPO / "conf" / "smoke.yaml", [f"runtime.output_dir={tmp_path}/out"])
    tracking = TrackingContext(uri="sqlite:///unused.db", experiment="e", parent_run_id="p")
    return {"data_cfg": config.data, "source_digest": "d", "runtime": config.runtime, "tracking": tracking}


def test_run_stage_checks_the_folder_the_task_writes(tmp_path):
    """`run_stage` fills in the task's defaults as Prefect does, so a left-out parameter (here `lengths`) cannot
    give it another folder than the one the task run derives from its parameters and caches on."""
    from tasks.stages import prepare_preferences

    params = _parameters(tmp_path)
    folder = caching.task_stage_dir(prepare_preferences, **params)
    assert folder == caching.stage_dir("prepare_preferences", {**params, "lengths": None})
    assert folder == tmp_path.resolve() / "out" / "prepare_preferences" / folder.name
    assert folder.name == caching.stage_key("prepare_preferences", {**params, "lengths": None})
    # the runtime and the tracking context are not part of the key; every other parameter is
    moved = {**params, "runtime": params["runtime"].model_copy(update={"threads": 3})}
    assert caching.task_stage_dir(prepare_preferences, **moved) == folder
    limits = LengthLimits(prompt_tokens=1, pair_tokens=64, sft_tokens=64)
    assert caching.task_stage_dir(prepare_preferences, **params, lengths=limits) != folder


def test_current_stage_dir_needs_a_task_run():
    with pytest.raises(RuntimeError, match="running stage task"):
        caching.current_stage_dir()


@pytest.mark.parametrize(
    "output",
    [
        PreparedData(stage="prepare_preferences", path="/d", digest="1", manifest={"rows": {"train": 3}}),
        SFTModel(stage="supervised_finetune", path="/s", digest="2", metrics={"sft/loss": 1.5}, trained=True),
        RewardModel(stage="train_reward_model", path="/r", digest="3"),
        PolicyInit(
            stage="init_policy_models",
            path="/s",
            digest="2:3",
            policy_init="/s",
            reference_init="/s",
            value_init="/r",
            reward_model="/r",
            same_tokenizer=False,
        ),
        PPOPolicy(stage="train_policy_ppo", path="/p", digest="4", value_path="/v", updates=4),
        Evaluation(stage="evaluate_policies", path="/e", digest="5", warnings=["length"]),
    ],
)
def test_stage_outputs_keep_their_type_through_the_json_result_serializer(output: StageOutput):
    from prefect.serializers import JSONSerializer

    again = JSONSerializer().loads(JSONSerializer().dumps(output))
    assert type(again) is type(output) and again == output
    # a downstream key takes the digest of an upstream output, whatever its type
    assert caching.stage_key("s", {"x": output}) == caching.stage_key("s", {"x": StageOutput(**output.model_dump())})


def test_a_stage_runs_with_the_tags_that_have_a_concurrency_limit_and_honours_those(tmp_path, harness):
    """Without a `gpu` limit a GPU stage runs untagged (Prefect's check of a limit that does not exist can wait 2 s
    on a SQLite server); with one (as `flows/serve.py` sets) it keeps the tag and holds a slot while it runs, also
    when the limit was created within the 5 s Prefect remembers that the tag had none."""
    from prefect import flow, tags, task
    from prefect.client.orchestration import get_client
    from prefect.context import TaskRunContext
    from prefect.exceptions import ObjectNotFound

    from rlhf.config import RuntimeConfig

    @task(name="tagged_stage", tags=["gpu", "data"])
    def tagged_stage(runtime: RuntimeConfig, attempt: int) -> dict:
        run = TaskRunContext.get().task_run
        with get_client(sync_client=True) as client:
            try:
                holders = [str(h) for h in client.read_concurrency_limit_by_tag("gpu").active_slots]
            except ObjectNotFound:
                holders = []
        return {"tags": sorted(run.tags), "holds_gpu_slot": str(run.id) in holders}

    @flow
    def three_stages() -> list[dict]:
        runtime = RuntimeConfig(output_dir=str(tmp_path))
        # tasks tagged `gpu`, alone and in a `tags` block, run while no limit exists: Prefect then skips asking for
        # those tags for 5 s (in this process)
        gpu_only = tagged_stage.with_options(tags=["gpu"])
        assert gpu_only(runtime=runtime, attempt=-1)["holds_gpu_slot"] is False
        with tags("team"):
            assert gpu_only(runtime=runtime, attempt=0)["holds_gpu_slot"] is False
        first = caching.run_stage(tagged_stage, runtime=runtime, attempt=1)
        with get_client(sync_client=True) as client:
            client.create_concurrency_limit(tag="gpu", concurrency_limit=1)
        try:
            second = caching.run_stage(tagged_stage, runtime=runtime, attempt=2)
            with tags("team"):
                third = caching.run_stage(tagged_stage, runtime=runtime, attempt=3)
        finally:
            with get_client(sync_client=True) as client:
                client.delete_concurrency_limit_by_tag("gpu")
        return [first, second, third]

    first, second, third = three_stages()
    assert first == {"tags": [], "holds_gpu_slot": False}  # no limit: nothing to ask the server for
    assert second == {"tags": ["gpu"], "holds_gpu_slot": True}  # the limit is honoured; `data` has none
    assert third == {"tags": ["gpu", "team"], "holds_gpu_slot": True}  # also with the block's tag
    assert caching.limited_tags([]) == set()


def test_training_metrics_are_written_in_the_background_only_beside_a_free_core(monkeypatch):
    """A writer thread where torch's threads leave a core free; the training thread writes them itself where
    torch's threads take every core (a writer there stalls torch's parallel ops)."""
    import torch

    from rlhf.config import RuntimeConfig
    from tasks import tracking

    runtime = RuntimeConfig(device="cpu")
    threads = torch.get_num_threads()
    try:
        monkeypatch.setattr(tracking.os, "cpu_count", lambda: 2)
        torch.set_num_threads(2)
        assert not tracking.metrics_in_background(runtime)
        torch.set_num_threads(1)
        assert tracking.metrics_in_background(runtime)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("error", "status"), [(KeyboardInterrupt, "KILLED"), (TerminationSignal, "KILLED"), (RuntimeError, "FAILED")]
)
def test_a_stage_stopped_by_a_signal_ends_killed_and_a_failed_one_failed(tmp_path, error, status):
    """Ctrl-C or SIGTERM reaches a stage as a KeyboardInterrupt (in a run served by `make ui` too): its MLflow run
    ends KILLED, as the CLI ends it; any other error ends it FAILED."""
    from rlhf.tracking.client import Tracker
    from tasks.stage_runs import stage_run
    from tasks.tracking import TrackingContext

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "e", str(tmp_path / "artifacts"))
    parent = tracker.start_run("pipeline")
    context = TrackingContext(uri=tracker.uri, experiment="e", parent_run_id=parent)
    with pytest.raises(error), stage_run(context, "train_policy_ppo", tmp_path / "stage") as (_, run_id):
        raise error(signal.SIGTERM) if error is TerminationSignal else error()
    assert tracker.get_run(run_id).info.status == status


@pytest.mark.parametrize(("earlier_pipeline", "continued"), [("FINISHED", False), ("KILLED", True)])
def test_a_rerun_stage_continues_a_killed_pipelines_run_but_not_a_finished_ones(tmp_path, earlier_pipeline, continued):
    """A stage whose folder holds the run of an earlier flow run continues it only when that flow run's pipeline
    was killed (a rerun resumes its saved state); the run of a pipeline that ended well stays its own, under its own
    pipeline, and the later pipeline names no resumed run (a checkpoint used as it is reruns in every pipeline)."""
    from rlhf.tracking.client import Tracker
    from tasks.stage_runs import RESUMED_FROM_TAG, stage_run
    from tasks.tracking import TrackingContext

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "e", str(tmp_path / "artifacts"))
    folder = tmp_path / "stage"
    first = tracker.start_run("pipeline-first")
    context = TrackingContext(uri=tracker.uri, experiment="e", parent_run_id=first, flow_run_id="flow-1")
    with stage_run(context, "supervised_finetune", folder, resume=True) as (_, earlier_run):
        pass
    tracker.end_run(first, failed=earlier_pipeline != "FINISHED", killed=earlier_pipeline == "KILLED")
    second = tracker.start_run("pipeline-second")
    context = TrackingContext(uri=tracker.uri, experiment="e", parent_run_id=second, flow_run_id="flow-2")
    with stage_run(context, "supervised_finetune", folder, resume=True) as (_, run_id):
        pass
    assert (run_id == earlier_run) is continued
    assert tracker.get_run(earlier_run).data.tags["mlflow.parentRunId"] == (second if continued else first)
    assert (RESUMED_FROM_TAG in tracker.get_run(second).data.tags) is continued
    assert tracker.get_run(run_id).info.status == "FINISHED"
