"""Caching and retries of the real flow: changed settings, deleted outputs, and a failure injected mid-PPO."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from flows.pipeline import rlhf_pipeline
from flows.summary import format_summary
from rlhf.config import load_config
from rlhf.errors import ConfigError
from rlhf.models.loading import load_tokenizer
from tests.conftest import REPO, flow_run_artifacts, stage_name, task_runs, task_states

# end-to-end: real servers and processes (deselect with -m "not slow"); one xdist worker runs the module, whose tests
# share a Prefect test harness and an uninterrupted reference run
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("flow_resume")]


def _config(tmp_path, *extra):
    return load_config(
        REPO / "conf" / "smoke.yaml",
        [
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.artifact_location={tmp_path}/artifacts",
            f"runtime.output_dir={tmp_path}/out",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def uninterrupted_run(harness, tmp_path_factory) -> tuple[Path, dict]:
    """One uninterrupted run of the smoke config: (its folder, its summary). The reference the retried runs are
    compared with, and the starting point of the caching test (which reruns in its folder)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    return folder, rlhf_pipeline(_config(folder), return_state=True).result()


def test_reward_change_and_deleted_outputs(uninterrupted_run):
    tmp_path, first = uninterrupted_run
    cfg = _config(tmp_path)

    # a changed reward-model setting re-runs the reward model, PPO and evaluation; SFT and data are reused
    changed = rlhf_pipeline(_config(tmp_path, "reward.lr=1e-3"), return_state=True)
    states = task_states(changed.state_details.flow_run_id)
    assert states["prepare_preferences"] == "Cached" and states["supervised_finetune"] == "Cached"
    assert states["train_reward_model"] == "Completed"
    assert states["train_policy_ppo"] == "Completed" and states["evaluate_policies"] == "Completed"

    # a cached result whose files were deleted is recomputed, never returned dangling
    shutil.rmtree(first["policy_checkpoint"].rsplit("/final/", 1)[0])
    again = rlhf_pipeline(cfg, return_state=True)
    states = task_states(again.state_details.flow_run_id)
    assert states["train_reward_model"] == "Cached"
    assert states["train_policy_ppo"] == "Completed"
    assert Path(first["policy_checkpoint"]).is_dir()
    assert again.result()["eval/win_rate_gold"] == first["eval/win_rate_gold"]  # deterministic on CPU


def test_failure_mid_ppo_is_retried_and_resumes(harness, tmp_path, monkeypatch, uninterrupted_run):
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "train_policy_ppo:2")  # the first attempt dies after 2 of 4 updates
    cfg = _config(tmp_path)
    state = rlhf_pipeline(cfg, return_state=True)
    summary = state.result()
    assert task_states(state.state_details.flow_run_id)["train_policy_ppo"] == "Completed"

    client = MlflowClient(cfg.tracking.uri)
    ppo_runs = client.search_runs(
        [client.get_experiment_by_name(cfg.tracking.experiment).experiment_id], "tags.stage = 'train_policy_ppo'"
    )
    assert len(ppo_runs) == 1, "the retry continues the same MLflow run"
    run = ppo_runs[0]
    assert run.info.status == "FINISHED"
    assert "rlhf.resumed_from_flow_run" not in run.data.tags, "a retry resumes its own flow run's stage, no other"
    history = client.get_metric_history(run.info.run_id, "objective/kl")
    assert sorted(m.step for m in history) == [1, 2, 3, 4], "no step missing or logged twice"
    ppo_folder = Path(summary["policy_checkpoint"]).parent.parent
    assert (ppo_folder / ".failure_injected").read_text() == "2", "the first attempt really failed"

    # the retried result equals an uninterrupted run of the same config
    _, clean = uninterrupted_run
    assert clean["eval/win_rate_gold"] == summary["eval/win_rate_gold"]
    assert clean["eval/kl"] == pytest.approx(summary["eval/kl"], rel=1e-4, abs=1e-5)


def test_failure_mid_dpo_is_retried_resumes_and_matches_an_uninterrupted_dpo(monkeypatch, uninterrupted_run):
    """algorithm: dpo in the reference run's folder (data, SFT and reward model from its cache): the first attempt
    dies after 2 of 4 steps, the retry resumes from the state saved at step 2 and continues the same MLflow run; the
    stage recomputed from scratch (its folder deleted) gives the same policy and evaluation."""
    folder, _ = uninterrupted_run
    dpo = ["algorithm=dpo", "dpo.lr=1e-3", "dpo.save_every=1"]
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "train_policy_dpo:2")
    state = rlhf_pipeline(_config(folder, *dpo), return_state=True)
    retried = state.result()
    (dpo_task,) = [t for t in task_runs(state.state_details.flow_run_id) if t.name.startswith("train_policy_dpo")]
    assert (dpo_task.state.name, dpo_task.run_count) == ("Completed", 2)
    stage_folder = Path(retried["policy_checkpoint"]).parent.parent
    assert (stage_folder / ".failure_injected").read_text() == "2", "the first attempt really failed"
    client = MlflowClient(_config(folder).tracking.uri)
    experiment = client.get_experiment_by_name("rlhf-ppo").experiment_id
    (run,) = client.search_runs([experiment], "tags.stage = 'train_policy_dpo'")
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "dpo/loss")) == [1, 2, 3, 4]

    manifest = Path(retried["policy_checkpoint"]).parent / "manifest.json"
    retried_digest = json.loads(manifest.read_text())["digest"]
    monkeypatch.delenv("RLHF_INJECT_FAILURE")
    shutil.rmtree(stage_folder)
    clean = rlhf_pipeline(_config(folder, *dpo), return_state=True).result()
    digest = json.loads((Path(clean["policy_checkpoint"]).parent / "manifest.json").read_text())["digest"]
    assert retried["eval/win_rate_gold"] == clean["eval/win_rate_gold"]
    assert retried["eval/kl"] == pytest.approx(clean["eval/kl"], rel=1e-4, abs=1e-5)
    assert digest == retried_digest, "the resumed DPO trained the same weights as the uninterrupted one"


def test_sft_finetuning_an_existing_model_is_retried_and_resumes(harness, tmp_path, monkeypatch, tiny_checkpoints):
    """sft.model + sft.finetune: the SFT stage fine-tunes the given model; a failure after 4 of 8 steps is retried
    and resumes, and the later stages start from the fine-tuned checkpoint."""
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "supervised_finetune:4")
    tiny = tiny_checkpoints["policy"]
    cfg = _config(
        tmp_path, f"sft.model={tiny}", "sft.finetune=true", "sft.steps=8", "sft.save_every=2", "sft.max_length=128"
    )
    state = rlhf_pipeline(cfg, return_state=True)
    summary = state.result()
    (sft_task,) = [t for t in task_runs(state.state_details.flow_run_id) if t.name.startswith("supervised_finetune")]
    assert (sft_task.state.name, sft_task.run_count) == ("Completed", 2)
    assert summary["sft_checkpoint"] != tiny and Path(summary["sft_checkpoint"], "model.safetensors").is_file()

    client = MlflowClient(cfg.tracking.uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    (run,) = client.search_runs([experiment], "tags.stage = 'supervised_finetune'")
    assert run.info.status == "FINISHED" and run.data.params["sft.finetune"] == "True"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "sft/loss")] == [1, 8]  # each step once
    (init,) = client.search_runs([experiment], "tags.stage = 'init_policy_models'")
    assert init.data.params["policy_init"] == summary["sft_checkpoint"]


@pytest.mark.long
def test_data_parallel_ppo_stage_is_retried_and_resumes(harness, tmp_path, monkeypatch):
    """runtime.ppo_processes=2: the PPO stage runs as two gloo processes under torchrun; the first attempt dies after
    2 of 4 updates, the retry resumes both ranks from the saved state and logs into the same MLflow run."""
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "train_policy_ppo:2")
    cfg = _config(tmp_path, "runtime.ppo_processes=2", "runtime.device=cpu")
    state = rlhf_pipeline(cfg, return_state=True)
    summary = state.result()
    ppo_task = [t for t in task_runs(state.state_details.flow_run_id) if t.name.startswith("train_policy_ppo")]
    assert [(t.state.name, t.run_count) for t in ppo_task] == [("Completed", 2)]

    client = MlflowClient(cfg.tracking.uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    (run,) = client.search_runs([experiment], "tags.stage = 'train_policy_ppo'")
    assert run.info.status == "FINISHED" and run.data.params["ppo_processes"] == "2"
    for key in ("objective/kl", "objective/gold_score", "policy/clipfrac"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2, 3, 4], key
    folder = Path(summary["policy_checkpoint"]).parent.parent
    assert (folder / ".failure_injected").read_text() == "2", "the first attempt really failed"
    assert json.loads((folder / "launch_result.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in (folder / "rollouts").iterdir())[-1] == "update_00004.parquet"
    assert len(pd.read_parquet(folder / "rollouts" / "update_00004.parquet")) == cfg.ppo.batch_size  # both ranks
    assert 0.0 <= summary["eval/win_rate_gold"] <= 1.0
    # the processes' output drives the task's progress bar (the retry's, which finished the 4 updates)
    ppo_bars = [
        a
        for a in flow_run_artifacts(state.state_details.flow_run_id)
        if a.type == "progress" and a.description.startswith("PPO:")
    ]
    # newest first; the data-parallel bar shows the numbers a single process shows
    assert ppo_bars and ppo_bars[0].data == 100.0 and ppo_bars[0].description.startswith("PPO: step 4 of 4; score ")
    assert all(part in ppo_bars[0].description for part in ("KL ", "KL coef ", "gold ")), ppo_bars[0].description

    # a process count the batches cannot be split into is refused before anything runs
    with pytest.raises(ConfigError, match=r"runtime.ppo_processes=3: ppo.batch_size \(16\) must be divisible"):
        rlhf_pipeline(_config(tmp_path, "runtime.ppo_processes=3"))


def test_bad_data_fails_once_without_retries(harness, tmp_path):
    """Errors that retrying cannot fix (bad data) fail the task on its first attempt."""
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "q", "chosen": "same", "rejected": "same"}) for _ in range(5)))
    state = rlhf_pipeline(_config(tmp_path, "data.source=local", f"data.path={path}"), return_state=True)
    assert state.is_failed()

    runs = {stage_name(r): (r.run_count, r.state.name) for r in task_runs(state.state_details.flow_run_id)}
    assert runs["prepare_preferences"] == (1, "Failed"), runs
    assert "supervised_finetune" not in runs  # nothing downstream was loaded
    cfg = _config(tmp_path)
    client = MlflowClient(cfg.tracking.uri)
    parents = client.search_runs(
        [client.get_experiment_by_name(cfg.tracking.experiment).experiment_id], "tags.stage = 'prepare_preferences'"
    )
    assert [r.info.status for r in parents] == ["FAILED"]
    pipeline = client.get_run(parents[0].data.tags["mlflow.parentRunId"])
    assert pipeline.info.status == "FAILED", "a failed pipeline does not stay RUNNING in MLflow"


def test_a_reward_ensemble_runs_through_the_dag_is_cached_and_resumes(monkeypatch, uninterrupted_run):
    """reward.ensemble_size 2 in the reference run's folder: member 0 is the reference run's reward model (cached),
    member 1 trains with its own seed; its first attempt dies after 4 of 8 steps and the retry resumes from the state
    saved at step 4. The ensemble's stage logs each member's accuracy and their disagreement, PPO scores with both
    members and evaluates periodically with the alarm; a second run takes every stage from the cache."""
    folder, _ = uninterrupted_run
    ensemble = ["reward.ensemble_size=2", "reward.ensemble_objective=wco", "ppo.eval_every=2", "ppo.eval_n_prompts=8"]
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "train_reward_model:4")
    state = rlhf_pipeline(_config(folder, *ensemble, "reward.save_every=2"), return_state=True)
    summary = state.result()
    runs = task_runs(state.state_details.flow_run_id)
    members = sorted((t for t in runs if t.name.startswith("train_reward_model")), key=lambda t: t.run_count)
    assert [(t.state.name, t.run_count) for t in members] == [("Completed", 2), ("Completed", 2)]
    spec = json.loads((Path(summary["reward_checkpoint"]) / "ensemble.json").read_text())
    assert len(spec["members"]) == 2 and len(set(spec["member_digests"])) == 2, "the members differ"
    weights = [pd.read_json(Path(m) / "manifest.json", typ="series")["digest"] for m in spec["members"]]
    assert weights[0] != weights[1]
    assert spec["in_distribution_std"] > 0

    client = MlflowClient(_config(folder).tracking.uri)
    experiment = client.get_experiment_by_name("rlhf-ppo").experiment_id
    (combined,) = client.search_runs([experiment], "tags.stage = 'combine_reward_ensemble'")
    metrics = combined.data.metrics
    assert {"reward_ensemble/member_0_accuracy", "reward_ensemble/member_1_accuracy"} <= set(metrics)
    assert metrics["reward_ensemble/disagreement_chosen"] == pytest.approx(spec["in_distribution_std"])
    ppo = client.search_runs([experiment], "tags.stage = 'train_policy_ppo'", order_by=["start_time DESC"])[0]
    assert ppo.data.metrics["ensemble/std"] > 0
    assert [m.step for m in client.get_metric_history(ppo.info.run_id, "periodic_eval/disagreement_ratio")] == [0, 2, 4]
    assert summary["overoptimisation/alarm_step"] == -1.0, "a healthy smoke run: the alarm stays quiet"
    assert "over-optimisation alarm (no gold):      quiet at every periodic evaluation" in format_summary(summary)
    assert "eval/policy_distinct_2" in summary and "eval/overoptimisation_flag" in summary

    monkeypatch.delenv("RLHF_INJECT_FAILURE")
    again = rlhf_pipeline(_config(folder, *ensemble, "reward.save_every=2"), return_state=True)
    states = task_states(again.state_details.flow_run_id)
    assert states["train_reward_model"] == "Cached" and states["combine_reward_ensemble"] == "Cached"
    assert states["train_policy_ppo"] == "Cached"


def _member_runs(state) -> list[str]:
    """The states of a pipeline run's reward-model member stages, sorted."""
    return sorted(
        t.state.name for t in task_runs(state.state_details.flow_run_id) if stage_name(t) == "train_reward_model"
    )


def test_an_ensemble_of_two_model_families_runs_through_the_dag_is_cached_and_resumes(
    monkeypatch, uninterrupted_run, family_checkpoint
):
    """reward.ensemble_models: tiny random Llama and Qwen2 checkpoints, each with a tokenizer of its own (neither the
    bootstrapped policy's). Each member trains from its model with its tokenizer; its first attempt dies after 4 of 8
    steps and the retry resumes. The policy stage (gae with the value head on the policy's trunk: member 0 reads
    other tokens) and the evaluation score each member on the decoded text in its own tokens. A second run takes
    every stage from the cache; another second model retrains that member alone."""
    folder, _ = uninterrupted_run
    llama, qwen2, gpt2 = (str(family_checkpoint(family)) for family in ("llama", "qwen2", "gpt2"))

    def config(*models: str):
        listed = f"reward.ensemble_models=[{', '.join(models)}]"
        return _config(folder, listed, "ppo.value_model=policy_head", "ppo.eval_every=2", "reward.save_every=2")

    monkeypatch.setenv("RLHF_INJECT_FAILURE", "train_reward_model:4")
    state = rlhf_pipeline(config(llama, qwen2), return_state=True)
    summary = state.result()
    runs = task_runs(state.state_details.flow_run_id)
    members = [t for t in runs if stage_name(t) == "train_reward_model"]
    assert [(t.state.name, t.run_count) for t in members] == [("Completed", 2), ("Completed", 2)], "resumed"
    spec = json.loads((Path(summary["reward_checkpoint"]) / "ensemble.json").read_text())
    inits = [json.loads((Path(m) / "manifest.json").read_text())["init"] for m in spec["members"]]
    assert inits == [llama, qwen2], "member k trains from the k-th model"
    vocabularies = [load_tokenizer(m).get_vocab() for m in spec["members"]]
    assert vocabularies[0] != vocabularies[1] and vocabularies[0] == load_tokenizer(llama).get_vocab()

    client = MlflowClient(_config(folder).tracking.uri)
    ppo = client.get_run(summary["stage.train_policy_ppo.run_id"])
    assert ppo.data.params["reward_retokenizes"] == "True"
    assert ppo.data.metrics["ensemble/std"] > 0
    assert [m.step for m in client.get_metric_history(ppo.info.run_id, "periodic_eval/disagreement_ratio")] == [0, 2, 4]
    assert summary["eval/policy_ensemble_std"] > 0 and summary["eval/sft_ensemble_std"] > 0, "the evaluation's view"

    monkeypatch.delenv("RLHF_INJECT_FAILURE")
    again = rlhf_pipeline(config(llama, qwen2), return_state=True)
    assert _member_runs(again) == ["Cached", "Cached"]
    states = task_states(again.state_details.flow_run_id)
    assert states["combine_reward_ensemble"] == "Cached" and states["evaluate_policies"] == "Cached"

    changed = rlhf_pipeline(config(llama, gpt2), return_state=True)
    assert _member_runs(changed) == ["Cached", "Completed"], "only the changed member trains"
    spec = json.loads((Path(changed.result()["reward_checkpoint"]) / "ensemble.json").read_text())
    assert [json.loads((Path(m) / "manifest.json").read_text())["init"] for m in spec["members"]] == [llama, gpt2]


def test_an_own_sft_ensemble_trains_each_member_from_an_sft_of_its_own(uninterrupted_run):
    """reward.ensemble_trunks 'own_sft' in the reference run's folder: member 0 is the reference run's reward model,
    from its SFT checkpoint (both cached); member 1 trains from an SFT stage of its own, with its seed (the tiny
    GPT-2 pretrained anew). A second run takes every stage from the cache."""
    folder, first = uninterrupted_run
    own = ["reward.ensemble_size=2", "reward.ensemble_trunks=own_sft"]
    state = rlhf_pipeline(_config(folder, *own), return_state=True)
    summary = state.result()
    runs = task_runs(state.state_details.flow_run_id)
    sfts = sorted(t.state.name for t in runs if stage_name(t) == "supervised_finetune")
    assert sfts == ["Cached", "Completed"] and _member_runs(state) == ["Cached", "Completed"]
    spec = json.loads((Path(summary["reward_checkpoint"]) / "ensemble.json").read_text())
    parents = [json.loads((Path(m) / "manifest.json").read_text())["init"] for m in spec["members"]]
    # member 0 came from the cache: the stage folder it was trained in may be another test's with the same content
    # (the folder's name is the content's key), as is the pipeline's SFT checkpoint
    named = {Path(p).name for p in (parents[0], first["sft_checkpoint"], summary["sft_checkpoint"])}
    assert len(named) == 1, "member 0: the pipeline's SFT"
    assert parents[1] != parents[0] and "/supervised_finetune/" in parents[1], "member 1: an SFT of its own"
    assert (
        json.loads((Path(parents[1]) / "manifest.json").read_text())["digest"]
        != json.loads((Path(parents[0]) / "manifest.json").read_text())["digest"]
    )
    client = MlflowClient(_config(folder).tracking.uri)
    experiment = client.get_experiment_by_name("rlhf-ppo").experiment_id
    seeds = {r.data.params.get("seed") for r in client.search_runs([experiment], "tags.stage = 'supervised_finetune'")}
    assert "7919" in seeds, "member 1's SFT ran with its own seed"

    again = rlhf_pipeline(_config(folder, *own), return_state=True)
    runs = task_runs(again.state_details.flow_run_id)
    assert {t.state.name for t in runs if stage_name(t) in ("supervised_finetune", "train_reward_model")} == {"Cached"}
    assert task_states(again.state_details.flow_run_id)["combine_reward_ensemble"] == "Cached"


@pytest.mark.parametrize("mode", ["warn", "stop", "keep_best"])
def test_the_alarm_fires_on_a_planted_reward_and_picks_the_policy(mode, uninterrupted_run):
    """A reward that pays for repeated words (tests/planted_rewards.py), no KL penalty and a high learning rate:
    the policy learns to repeat itself, the alarm fires at a periodic evaluation, the summary warns, the runs are
    tagged, and ppo.on_overoptimisation keeps the policy: 'warn' the last one (which the evaluation stage's own
    check flags too), 'stop' the one of the evaluation before the alarm (and trains no further), 'keep_best' the
    best-scored one before it."""
    folder, _ = uninterrupted_run
    planted = [
        "reward.source=function",
        "reward.function=tests.planted_rewards:repeated_words",
        "ppo.advantage_estimator=rloo",
        "ppo.samples_per_prompt=4",
        "ppo.kl_coef=0",
        "ppo.lr=1e-2",
        "ppo.total_episodes=192",
        "ppo.eval_every=2",
        "ppo.eval_n_prompts=16",
        f"ppo.on_overoptimisation={mode}",
    ]
    state = rlhf_pipeline(_config(folder, *planted), return_state=True)
    summary = state.result()
    alarm, kept = summary["overoptimisation/alarm_step"], summary["overoptimisation/kept_step"]
    assert 0 < alarm < 12, "the alarm fires before the last update"
    assert "distinct bigrams" in summary["rlhf.overoptimisation_alarm"]
    assert (
        f"RLOO's periodic evaluation: the policy looks like it games its reward from update {alarm:.0f}"
        in (summary["eval.warning"])
    )
    client = MlflowClient(_config(folder).tracking.uri)
    pipeline = client.get_run(summary["mlflow_run_id"])
    assert "rlhf.overoptimisation_alarm" in pipeline.data.tags
    (table,) = [a for a in flow_run_artifacts(state.state_details.flow_run_id) if a.key == "rlhf-evaluation"]
    assert f"| over-optimisation alarm (no gold) | fired after update {alarm:.0f} (WARNING below)" in table.data
    warning = f"RLOO's periodic evaluation: the policy looks like it games its reward from update {alarm:.0f}"
    assert f"**WARNING:** {warning}" in table.data
    ppo_run = client.get_run(summary["stage.train_policy_ppo.run_id"])
    assert "rlhf.overoptimisation_alarm" in ppo_run.data.tags
    updates = [m.step for m in client.get_metric_history(ppo_run.info.run_id, "objective/kl")]
    printed = format_summary(summary)
    assert f"fired after update {alarm:.0f} (WARNING below)" in printed
    assert (f"the final policy is update {kept:.0f}'s" in printed) == (mode != "warn")
    other = "ppo.on_overoptimisation=stop" if mode == "warn" else "ppo.on_overoptimisation=warn"
    assert f"rerun with {other}" in summary["eval.warning"], "the WARNING says how to get the other policy"
    if mode == "warn":
        assert kept == -1 and max(updates) == 12
        assert summary["eval/overoptimisation_flag"] == 1.0, "the evaluation stage's check of the final policy agrees"
        return
    signs = {
        m.step: m.value for m in client.get_metric_history(ppo_run.info.run_id, "periodic_eval/overoptimisation_sign")
    }
    quiet = [step for step, sign in signs.items() if step < alarm and sign == 0]
    assert signs[alarm] == 1 and 0 in quiet, "the alarm's evaluation shows its sign; the SFT policy's is quiet"
    if mode == "stop":
        assert kept == max(quiet) and max(updates) == alarm, "stopped at the alarm, the last quiet evaluation kept"
    else:
        assert kept in quiet and max(updates) == 12, "trained on, a quiet evaluation before the alarm kept"
        scores = {m.step: m.value for m in client.get_metric_history(ppo_run.info.run_id, "periodic_eval/score")}
        assert scores[kept] == max(scores[step] for step in quiet)


@pytest.mark.parametrize(
    "objective",
    [
        ["ppo.advantage_estimator=dapo"],
        ["ppo.advantage_estimator=grpo", "ppo.importance_sampling_level=sequence"],
        ["ppo.advantage_estimator=rloo", "ppo.importance_sampling_level=sequence_sum"],
    ],
    ids=["dapo", "gspo", "rloo_sequence"],
)
def test_dapo_gspo_and_sequence_rloo_run_the_dag_resume_and_are_cached(objective, monkeypatch, uninterrupted_run):
    """Each new objective in the reference run's folder (data, SFT and reward model from its cache): the first
    attempt of the policy stage dies after 2 of 4 updates, the retry resumes the same MLflow run with no step missing
    or twice, the summary names the objective, and a second run takes every stage from the cache."""
    folder, _ = uninterrupted_run
    overrides = [*objective, "ppo.samples_per_prompt=4", "ppo.save_every=1"]
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "train_policy_ppo:2")
    state = rlhf_pipeline(_config(folder, *overrides), return_state=True)
    summary = state.result()
    (ppo_task,) = [t for t in task_runs(state.state_details.flow_run_id) if t.name.startswith("train_policy_ppo")]
    assert (ppo_task.state.name, ppo_task.run_count) == ("Completed", 2)
    client = MlflowClient(_config(folder).tracking.uri)
    run = client.get_run(summary["stage.train_policy_ppo.run_id"])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "policy/loss")) == [1, 2, 3, 4]
    label = {"dapo": "DAPO", "sequence": "GSPO", "sequence_sum": "RLOO (sequence)"}
    expected = label.get(objective[-1].rsplit("=", 1)[1])
    assert summary["rlhf.objective_label"] == expected
    if "dapo" in objective[0]:
        assert "dynamic_sampling/extra_rounds" in run.data.metrics
    else:
        assert "policy/seq_clipfrac" in run.data.metrics

    monkeypatch.delenv("RLHF_INJECT_FAILURE")
    again = rlhf_pipeline(_config(folder, *overrides), return_state=True)
    assert task_states(again.state_details.flow_run_id)["train_policy_ppo"] == "Cached"
    assert again.result()["eval/win_rate_gold"] == summary["eval/win_rate_gold"]
