"""End to end: the real Prefect flow on conf/smoke.yaml with a temporary SQLite MLflow store."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect.results import ResultStore

from flows.pipeline import rlhf_pipeline
from flows.summary import (
    COMPUTE_TAG,
    PPO_EPISODES,
    SFT_STEPS,
    format_summary,
    plumbing_check,
    summary_block,
    sweep_note,
)
from rlhf.config import load_config
from rlhf.models.device import compute_dtype, dtype_reason
from rlhf.stages import STAGE_TASKS, STAGES, stages_of
from rlhf.tracking.client import SOURCE_NAME_TAG, SOURCE_TYPE_TAG
from tasks.outputs import Evaluation, PolicyInit, PPOPolicy, PreparedData, RewardModel, SFTModel
from tasks.policy_stages import SFT_SIDE_REUSED_TAG
from tests.conftest import REPO, flow_run_artifacts, flow_run_logs, task_states


def test_pipeline_runs_logs_and_is_cached(harness, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(
        REPO / "conf" / "smoke.yaml",
        [
            f"tracking.uri={uri}",
            f"tracking.artifact_location={tmp_path}/artifacts",
            f"runtime.output_dir={tmp_path}/out",
            "tracking.registered_model=rlhf-policy",
        ],
    )
    first = rlhf_pipeline(cfg, return_state=True)
    summary = first.result()
    assert 0.0 <= summary["reward/best_eval_accuracy"] <= 1.0
    assert "eval/win_rate_gold" in summary and "eval/kl" in summary
    # the smoke config's budget makes it a plumbing check, and the printed summary says so first
    assert (summary[PPO_EPISODES], summary[SFT_STEPS]) == (cfg.ppo.total_episodes, cfg.sft.steps)
    printed = format_summary(summary).splitlines()
    # the header: what the run computed in ('auto' resolved on this machine at the model's width) and why, then the note
    assert cfg.runtime.model_width == cfg.sft.bootstrap.n_embd
    device = torch.device("cpu")
    dtype = compute_dtype("auto", device, width=cfg.runtime.model_width)
    assert summary[COMPUTE_TAG] == f"cpu {str(dtype).removeprefix('torch.')}"
    reason = dtype_reason("auto", device, width=cfg.runtime.model_width)
    assert printed[2] == f"{'computed in:':<39} {summary[COMPUTE_TAG]} ({reason})"
    assert printed[3].startswith("NOTE: a plumbing check, not learning: 64 PPO episodes")
    assert plumbing_check(summary) and "NOTE" not in format_summary({**summary, PPO_EPISODES: 6400, SFT_STEPS: 400})
    # the store the run logged to, and where that came from (the override: MLFLOW_TRACKING_URI is not set here)
    assert f"{'MLflow store':<40}{uri} (tracking.uri)" in format_summary(summary).splitlines()
    # ... and so does every place a run started from the browser is looked at: the flow run's log, the evaluation
    # table's description (and a row), the MLflow run's description
    note = "NOTE: a plumbing check, not learning: 64 PPO episodes"
    flow_run = first.state_details.flow_run_id
    logs = flow_run_logs(flow_run)
    assert any(message.startswith(note) for message in logs)
    # the log ends with the summary the terminal prints: the win rates, the KL and the alarm's line
    (block,) = [message for message in logs if message.startswith("== RLHF pipeline summary")]
    assert block == summary_block(summary).strip("\n")
    assert "PPO beats SFT on gold reward:" in block and "mean KL(PPO || SFT) per response:" in block
    assert "over-optimisation alarm (no gold):      quiet at every periodic evaluation" in block
    # the evaluation artifact: the same lines as a short table in words, the alarm's among them
    (table,) = [a for a in flow_run_artifacts(flow_run) if a.key == "rlhf-evaluation"]
    assert table.type == "markdown" and table.description.startswith(note)
    assert note.removeprefix("NOTE: ") in table.data and "| PPO beats SFT on gold reward | " in table.data
    assert "| mean KL(PPO \\|\\| SFT) per response | " in table.data  # pipes escaped in a cell
    assert "| over-optimisation alarm (no gold) | quiet at every periodic evaluation |" in table.data
    assert "eval/" not in table.data  # words, not metric keys: those are in the figures table it links
    (figures,) = [a for a in flow_run_artifacts(flow_run) if a.key == "rlhf-evaluation-figures"]
    assert {"eval/kl", "eval/win_rate_gold"} <= {row["metric"] for row in json.loads(figures.data)}
    assert "this run beside the last" not in table.data  # the experiment's first run: nothing to compare it with

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id])
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["stage"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert len(parent) == 1
    # stage runs are named after their pipeline run, so chart legends tell runs apart
    short = {"prepare_preferences": "data", "supervised_finetune": "sft", "train_reward_model": "reward"}
    short |= {"init_policy_models": "init", "train_policy_ppo": "ppo", "evaluate_policies": "eval"}
    for stage, run in children.items():
        assert run.info.run_name == f"{parent[0].info.run_name}/{short[stage]}", stage
    assert parent[0].data.tags["mlflow.note.content"].startswith(note)
    assert parent[0].data.tags["rlhf.cached"] == "false"
    assert parent[0].data.tags[COMPUTE_TAG] == summary[COMPUTE_TAG]  # the resolved dtype, logged
    assert parent[0].data.params["ppo.kl_coef"] == str(cfg.ppo.kl_coef)
    assert parent[0].data.tags["prefect.flow_run_id"] == str(first.state_details.flow_run_id)
    assert set(children) == {
        "prepare_preferences",
        "supervised_finetune",
        "train_reward_model",
        "init_policy_models",
        "train_policy_ppo",
        "evaluate_policies",
    }
    # MLflow's source of every run (the run page's Source): the flow's file, not Prefect's engine.py
    for run in [*parent, *children.values()]:
        assert run.data.tags[SOURCE_NAME_TAG] == "flows/pipeline.py", run.info.run_name
        assert run.data.tags[SOURCE_TYPE_TAG] == "LOCAL", run.info.run_name

    ppo = children["train_policy_ppo"]
    for key in (
        "objective/kl",
        "objective/scores",
        "policy/loss",
        "value/loss",
        "policy/clipfrac",
        "policy/approxkl",
        "time/total",
        "speed/episodes_per_s",
    ):
        history = client.get_metric_history(ppo.info.run_id, key)
        assert [m.step for m in history] == [1, 2, 3, 4], key
    rm_hist = client.get_metric_history(children["train_reward_model"].info.run_id, "reward/eval/accuracy")
    assert rm_hist, "reward model logs held-out accuracy"

    def artifacts(run, path=""):
        return {a.path for a in client.list_artifacts(run.info.run_id, path)}

    assert "data" in artifacts(children["prepare_preferences"])
    assert "data/train.parquet" in artifacts(children["prepare_preferences"], "data")
    assert "sft_checkpoint/model.safetensors" in artifacts(children["supervised_finetune"], "sft_checkpoint")
    assert "reward_model/model.safetensors" in artifacts(children["train_reward_model"], "reward_model")
    assert {"ppo_checkpoint", "rollouts", "rollout_samples.json"} <= artifacts(ppo)
    # the PPO policy is an MLflow transformers model of the PPO run (Models column, load_model, models serve)
    import mlflow

    (model,) = client.search_logged_models([exp.experiment_id])
    assert model.source_run_id == ppo.info.run_id and model.name == "policy_model"
    assert model.tags[SOURCE_NAME_TAG] == "flows/pipeline.py"  # the Models tab's "Logged from"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # as a user would, to resolve models:/ URIs
    generate = mlflow.transformers.load_model(f"models:/{model.model_id}")
    assert generate("Review of The Silent River:", max_new_tokens=3)[0]["generated_text"]
    assert "completions.json" in artifacts(children["evaluate_policies"])
    # lengths, empty answers, win rates at equal length and the hacking flags: on the evaluation and pipeline runs
    evaluation = children["evaluate_policies"].data
    for key in (
        "eval/policy_length_mean",
        "eval/sft_empty_rate",
        "eval/win_rate_rm_len_controlled",
        "eval/win_rate_gold_len_controlled",
        "eval/hacking_flag_length",
        "eval/hacking_flag_empty",
    ):
        assert evaluation.metrics[key] == pytest.approx(summary[key]), key
        assert parent[0].data.metrics[key] == pytest.approx(summary[key]), key
    assert evaluation.tags.get("eval.warning") == summary.get("eval.warning")
    assert parent[0].data.tags.get("eval.warning") == summary.get("eval.warning")

    # the prepared data are dataset inputs of the runs that use them (schema and row count, no rows read)
    def inputs(run):
        context = {
            d.dataset.name: {t.key: t.value for t in d.tags}["mlflow.data.context"] for d in run.inputs.dataset_inputs
        }
        return set(context.items())

    assert inputs(children["train_reward_model"]) == {
        ("preferences-train", "training"),
        ("preferences-eval", "evaluation"),
    }
    assert inputs(children["train_policy_ppo"]) == {("ppo-prompts", "training")}
    assert inputs(children["evaluate_policies"]) == {("preferences-eval", "evaluation")}
    assert inputs(client.get_run(parent[0].info.run_id)) == inputs(children["prepare_preferences"])
    assert len(inputs(children["prepare_preferences"])) == 4
    (train,) = [d.dataset for d in children["train_reward_model"].inputs.dataset_inputs if "train" in d.dataset.name]
    assert json.loads(train.profile)["num_rows"] == cfg.data.synthetic.n_train_pairs
    # each file's own content digest (the four prepared files are told apart); the folder's digest is a tag
    from rlhf.checkpoints import file_digest

    assert train.digest == file_digest(Path(summary["data"]) / "train.parquet")[:36]
    digests = {d.dataset.name: d.dataset.digest for d in children["prepare_preferences"].inputs.dataset_inputs}
    assert len(set(digests.values())) == 4, digests
    tags = {t.key: t.value for d in children["train_reward_model"].inputs.dataset_inputs for t in d.tags}
    assert tags["rlhf.prepared_digest"] == summary["data_digest"]
    assert {"name": "prompt", "type": "string", "required": True} in json.loads(train.schema)["mlflow_colspec"]

    # the PPO policy is a version of the registered model, tagged with the evaluation, and loads from the registry
    assert summary["registered_policy"] == "models:/rlhf-policy/1"
    version = client.get_model_version("rlhf-policy", "1")
    assert version.run_id == ppo.info.run_id
    assert float(version.tags["eval/win_rate_gold"]) == pytest.approx(summary["eval/win_rate_gold"], rel=1e-5)
    from mlflow.artifacts import download_artifacts
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # as a user would, to resolve models:/ URIs
    local = download_artifacts(artifact_uri="models:/rlhf-policy/1", dst_path=str(tmp_path / "registry"))
    assert AutoModelForCausalLM.from_pretrained(local).config.model_type == "gpt2"

    # the Prefect side: the drop table of the prepare stage is a table artifact of the flow run
    first_artifacts = flow_run_artifacts(first.state_details.flow_run_id)
    drops = [a for a in first_artifacts if a.key == "prepare-preferences-drops"]
    assert [a.type for a in drops] == ["table"]
    # the link opens the run's page in MLflow's model-training view; the card's text names the absolute store
    (link,) = [a for a in first_artifacts if a.key == "rlhf-mlflow-run"]
    run_url = f"/#/experiments/{exp.experiment_id}/runs/{parent[0].info.run_id}?workflowType=machine_learning"
    assert run_url in link.data and uri in link.description and " or ." not in link.description
    # the evaluation table links each stage's MLflow run, marked as run here
    (table,) = [a for a in first_artifacts if a.key == "rlhf-evaluation"]
    (ppo_row,) = [line for line in table.data.splitlines() if line.startswith("| PPO | ")]
    assert ppo_row.startswith("| PPO | ran | [its run](http") and f"/runs/{ppo.info.run_id}?" in ppo_row
    # the training tasks' progress bars carry the numbers users watch, named by the objective that trains
    bars = {a.description.split(":")[0]: a.description for a in first_artifacts if a.type == "progress"}
    assert "score" in bars["PPO"] and "KL" in bars["PPO"] and "KL coef" in bars["PPO"] and "gold" in bars["PPO"]
    assert "loss" in bars["reward"] and "held-out acc" in bars["reward"]

    # every stage wrote exactly one folder, named by the key Prefect cached its result under (its typed output), the
    # folder `run_stage` locked and checked, and the one its MLflow run records
    outputs = {
        "prepare_preferences": PreparedData,
        "supervised_finetune": SFTModel,
        "train_reward_model": RewardModel,
        "init_policy_models": PolicyInit,
        "train_policy_ppo": PPOPolicy,
        "evaluate_policies": Evaluation,
    }
    assert set(outputs) == set(children)
    store = ResultStore()
    for stage, output_type in outputs.items():
        (folder,) = [path for path in (tmp_path / "out" / stage).resolve().iterdir() if path.is_dir()]
        assert folder.name.startswith(f"{stage}-"), stage
        cached = store.read(folder.name).result
        assert type(cached) is output_type and cached.mlflow_run_id == children[stage].info.run_id, stage
        assert {path.name for path in folder.parent.glob("*.lock")} == {f"{folder.name}.lock"}, stage
        assert children[stage].data.tags["output_dir"] == str(folder), stage
        if stage != "init_policy_models":  # the init's path is the SFT model's: the checkpoint PPO starts from
            assert Path(cached.path).resolve().is_relative_to(folder), stage
        if stage == "train_policy_ppo":
            assert Path(cached.value_path).resolve().is_relative_to(folder / "final")

    # second run: nothing changed, every stage is served from the cache (typed outputs read back), same summary
    second = rlhf_pipeline(cfg, return_state=True)
    assert second.result()["eval/win_rate_gold"] == summary["eval/win_rate_gold"]
    assert second.result()["value_checkpoint"] == summary["value_checkpoint"]
    assert second.result().get("eval.warning") == summary.get("eval.warning")
    # the second parent run links the stage runs that computed its (cached) results
    tags = client.get_run(second.result()["mlflow_run_id"]).data.tags
    assert tags["stage.train_policy_ppo.run_id"] == ppo.info.run_id
    states = task_states(second.state_details.flow_run_id)
    for stage in children:
        assert states[stage] == "Cached", (stage, states)
    assert second.result()["registered_policy"] == "models:/rlhf-policy/1"  # the same policy: no new version
    # ... and says so: tagged as cached, naming the run that produced the results; stages marked cached in its table
    assert tags["rlhf.cached"] == "true" and tags["rlhf.results_from_run"] == parent[0].info.run_id
    assert all(tags[f"stage.{stage}.cached"] == "true" for stage in children)
    (table,) = [a for a in flow_run_artifacts(second.state_details.flow_run_id) if a.key == "rlhf-evaluation"]
    (ppo_row,) = [line for line in table.data.splitlines() if line.startswith("| PPO | ")]
    assert ppo_row.startswith("| PPO | cached (an earlier run computed it) |") and ppo.info.run_id in ppo_row
    # and a link that compares the run with the experiment's previous one, in MLflow's model-training view
    (compare,) = re.findall(r"\[this run beside the last 1 in MLflow\]\((\S+)\)", table.data)
    assert "#/compare-runs?runs=" in compare and compare.endswith("workflowType=machine_learning")

    # a changed PPO setting re-runs PPO and evaluation only
    changed = cfg.model_copy(deep=True)
    changed.ppo.kl_coef = 0.2
    third = rlhf_pipeline(changed, return_state=True)
    states = task_states(third.state_details.flow_run_id)
    assert states["train_reward_model"] == "Cached" and states["supervised_finetune"] == "Cached"
    assert states["train_policy_ppo"] == "Completed" and states["evaluate_policies"] == "Completed"
    assert client.get_run(third.result()["mlflow_run_id"]).data.tags["rlhf.cached"] == "partial"
    # ... and its evaluation reads the SFT policy's side the first one sampled (same SFT, scorer, prompts, sampling)
    (third_eval,) = [
        r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("stage") == "evaluate_policies"
        and r.info.run_id != children["evaluate_policies"].info.run_id
    ]  # fmt: skip
    assert children["evaluate_policies"].data.tags[SFT_SIDE_REUSED_TAG] == "false"
    assert third_eval.data.tags[SFT_SIDE_REUSED_TAG] == "true"
    assert third_eval.data.params["eval.sft_side"] == children["evaluate_policies"].data.params["eval.sft_side"]
    for key in ("eval/sft_score", "eval/sft_length_mean", "eval/sft_gold", "eval/sft_empty_rate"):
        assert third.result()[key] == summary[key], key
    assert third.result()["registered_policy"] == "models:/rlhf-policy/2"


def test_the_stage_table_names_the_flows_tasks_in_order():
    """rlhf/stages.py is the one list of stages: the Prefect tasks' names, in the order the flow runs them,
    each with its own MLflow run suffix."""
    import inspect

    from prefect import Task

    import flows.pipeline
    import tasks.policy_stages
    import tasks.stages

    modules = (tasks.stages, tasks.policy_stages)
    names = {t.name for module in modules for t in vars(module).values() if isinstance(t, Task)}
    assert set(STAGE_TASKS) == names
    # in the flow's order, each stage where it is first called (reward.ensemble_trunks 'own_sft' calls the SFT stage
    # again for the members), by `run_stage` or the flow's `run`, which adds what `hand_out` gave the stage
    found = re.findall(r"\brun(?:_stage)?\(\s*(\w+),", inspect.getsource(flows.pipeline))
    called = dict.fromkeys(name for name in found if name in names)
    assert tuple(called) == STAGE_TASKS
    assert len({stage.short for stage in STAGES}) == len(STAGES)
    assert [stage.short for stage in stages_of()] == ["data", "sft", "reward", "init", "ppo", "eval"]
    assert [stage.short for stage in stages_of("dpo", "model")] == ["data", "sft", "reward", "dpo", "eval"]
    assert [stage.short for stage in stages_of("ppo", "function")] == ["data", "sft", "init", "ppo", "eval"]


@pytest.mark.parametrize(
    ("budget", "says"),
    [
        ({PPO_EPISODES: 6400, SFT_STEPS: 400}, None),  # conf/default.yaml
        ({PPO_EPISODES: 6400}, None),  # a pretrained SFT model: its steps do not count
        ({PPO_EPISODES: 64, SFT_STEPS: 30}, "64 PPO episodes (under 1024) and 30 SFT steps of a policy trained"),
        ({PPO_EPISODES: 64}, "a plumbing check, not learning: 64 PPO episodes (under 1024) are too few"),
        ({PPO_EPISODES: 6400, SFT_STEPS: 30}, "30 SFT steps of a policy trained from scratch (under 100)"),
        ({}, None),  # a summary from before the budget was in it
    ],
)
def test_a_tiny_budget_is_called_a_plumbing_check(budget, says):
    note = plumbing_check(budget)
    assert note is None if says is None else says in note


def test_the_summary_names_the_objective_that_trained():
    """A GRPO run's summary says GRPO in its note, its figures and its stages, never PPO (the terminal's lines, the
    flow run's log and the evaluation table are these)."""
    summary = {
        "rlhf.objective_label": "GRPO",
        PPO_EPISODES: 64,
        "eval/win_rate_rm": 0.5,
        "eval/kl": 0.1,
        "overoptimisation/alarm_step": 3.0,
        "stage.init_policy_models.run_id": "a",
        "stage.init_policy_models.cached": "true",
        "stage.train_policy_ppo.run_id": "b",
        "stage.train_policy_ppo.cached": "true",
    }
    block = summary_block(summary)
    assert "64 GRPO episodes (under 1024)" in block and "GRPO beats SFT on reward-function score:" in block
    assert "mean KL(GRPO || SFT) per response:" in block and "(GRPO init, GRPO)" in block
    assert "over-optimisation alarm (no gold):      fired after update 3 (WARNING below)" in block
    assert "PPO" not in block
    grpo = load_config(REPO / "conf" / "smoke.yaml", ["ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4"])
    assert "64 GRPO episodes" in sweep_note([grpo])


@pytest.mark.slow
def test_dpo_and_a_rule_rewarded_grpo_run_the_dag_and_share_its_cached_stages(harness, tmp_path):
    """algorithm: dpo trains the DPO stage instead of init and PPO and is evaluated as PPO is; reward.source: function
    skips the reward-model stage; both reuse the data and SFT stages; a second DPO run comes from the cache."""
    base = [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"tracking.artifact_location={tmp_path}/artifacts",
        f"runtime.output_dir={tmp_path}/out",
    ]
    dpo = load_config(REPO / "conf" / "smoke.yaml", [*base, "algorithm=dpo", "dpo.lr=1e-3"])
    summary = rlhf_pipeline(dpo)
    ran = {key.split(".")[1] for key in summary if key.startswith("stage.") and key.endswith(".run_id")}
    assert ran == {"prepare_preferences", "supervised_finetune", "train_reward_model", "train_policy_dpo",
                   "evaluate_policies"}  # fmt: skip
    assert summary["rlhf.objective_label"] == "DPO" and "DPO beats SFT" in format_summary(summary)
    assert (Path(summary["policy_checkpoint"]) / "config.json").is_file() and "eval/kl" in summary
    again = rlhf_pipeline(dpo)
    assert all(again[f"stage.{stage}.cached"] == "true" for stage in ran)

    rule = ["reward.source=function", "reward.function=rlhf.data.synthetic:gold_reward"]
    grpo = load_config(
        REPO / "conf" / "smoke.yaml", [*base, *rule, "ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4"]
    )
    state = rlhf_pipeline(grpo, return_state=True)
    summary = state.result()
    assert "stage.train_reward_model.run_id" not in summary and "reward/best_eval_accuracy" not in summary
    # a GRPO run is called GRPO wherever it is described: the log's step lines and note, the progress bars, the
    # evaluation table, the MLflow run's tag (a column of the saved view)
    logs = flow_run_logs(state.state_details.flow_run_id)
    assert any(re.match(r"GRPO step \d+ of \d+: score ", m) for m in logs) and not any("ppo step" in m for m in logs)
    assert any(m.startswith("NOTE: a plumbing check, not learning: 64 GRPO episodes") for m in logs)
    artifacts = flow_run_artifacts(state.state_details.flow_run_id)
    bars = {a.description for a in artifacts if a.type == "progress"}
    assert "RLHF pipeline: evaluation done (5/5), finished" in bars and any(b.startswith("GRPO: step ") for b in bars)
    (table,) = [a for a in artifacts if a.key == "rlhf-evaluation"]
    assert "| GRPO beats SFT on gold reward |" in table.data and "| GRPO | ran |" in table.data
    assert "PPO" not in table.data
    tags = MlflowClient(base[0].split("=", 1)[1]).get_run(summary["mlflow_run_id"]).data.tags
    assert tags["rlhf.objective_label"] == "GRPO"
    assert summary["stage.supervised_finetune.cached"] == "true"  # shared with the DPO run
    assert summary["value_checkpoint"].startswith("none")
    assert summary["eval/win_rate_rm"] == summary["eval/win_rate_gold"]  # the function is the gold reward
