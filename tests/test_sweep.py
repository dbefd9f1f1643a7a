"""Sweeps: space validation and expansion (no Prefect), and the sweep flow end to end on a tiny smoke config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlhf.config import load_config
from rlhf.errors import ConfigError
from rlhf.sweeps.optuna_search import check_points
from rlhf.sweeps.ranking import ranking
from rlhf.sweeps.space import VariantList, expand, load_space, parse_space, variant_config, variant_configs
from tests.conftest import REPO, flow_run_artifacts, stage_name, subflow_runs, task_runs

# A pipeline that takes seconds: the smoke config made smaller still.
TINY = ["ppo.total_episodes=32", "ppo.batch_size=16", "eval.n_prompts=8", "eval.batch_size=8"]


def space(**raw):
    return parse_space({"name": "t", **raw})


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"parameters": {"ppo.kl_cof": [0.1]}}, "parameters.ppo.kl_cof is not a config key (ppo has no field"),
        ({"parameters": {"ppo": [1]}}, "parameters.ppo is a config section"),
        ({"parameters": {"ppo.lr.x": [1]}}, "parameters.ppo.lr.x is not a config key ('ppo.lr' is a value)"),
        ({"parameters": {"tracking.uri": ["a"]}}, "parameters.tracking.uri: a sweep cannot vary tracking"),
        ({"parameters": {"ppo.lr": []}}, "parameters.ppo.lr is an empty list"),
        ({"parameters": {"ppo.lr": 0.1}}, "parameters.ppo.lr must be a list of values (grid) or {low, high, log}"),
        ({"parameters": {"ppo.lr": {"low": 1e-5, "high": 1e-3}}}, "parameters.ppo.lr is a range, which needs method"),
        ({"method": "random", "parameters": {"ppo.lr": {"low": 1, "high": 0.1}}}, "low (1.0) must be below high"),
        ({"method": "random", "parameters": {"ppo.lr": {"low": 0, "high": 1, "log": True}}}, "needs low > 0"),
        ({"method": "random", "parameters": {"ppo.lr": {"low": 0.1, "hi": 1}}}, "parameters.ppo.lr has unknown key"),
        ({"parameters": {}}, "sweep 't' has no parameters"),
        ({"parameters": {"ppo.lr": [1]}, "grid": 1}, "unknown key 'grid'"),
    ],
)
def test_space_errors_are_one_sentence_naming_the_key(raw, message):
    with pytest.raises(ConfigError) as err:
        space(**raw)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_grid_is_every_combination_in_order():
    variants = expand(space(parameters={"ppo.kl_coef": [0.01, 0.1], "ppo.lr": [1e-4, 3e-4, 1e-3]}))
    assert len(variants) == 6
    assert [v.index for v in variants] == list(range(6))
    assert variants[0].overrides == {"ppo.kl_coef": 0.01, "ppo.lr": 1e-4}
    assert variants[5].overrides == {"ppo.kl_coef": 0.1, "ppo.lr": 1e-3}
    assert variants[1].label == "ppo.kl_coef=0.01,ppo.lr=0.0003"


def test_random_draws_are_reproducible_and_in_range():
    params = {"ppo.lr": {"low": 1e-5, "high": 1e-3, "log": True}, "ppo.num_ppo_epochs": {"low": 1, "high": 4}}
    params["ppo.num_ppo_epochs"]["integer"] = True
    params["ppo.kl_coef"] = [0.02, 0.05]
    a = expand(space(method="random", n_random=20, seed=3, parameters=params))
    b = expand(space(method="random", n_random=20, seed=3, parameters=dict(reversed(list(params.items())))))
    c = expand(space(method="random", n_random=20, seed=4, parameters=params))
    assert len(a) == 20
    # the same seed gives the same draws, whatever the order of the keys in the file
    assert [sorted(v.overrides.items()) for v in a] == [sorted(v.overrides.items()) for v in b]
    assert [v.overrides for v in a] != [v.overrides for v in c]
    for v in a:
        assert 1e-5 <= v.overrides["ppo.lr"] <= 1e-3
        assert v.overrides["ppo.num_ppo_epochs"] in (1, 2, 3, 4)
        assert v.overrides["ppo.kl_coef"] in (0.02, 0.05)
    # log-uniform: about half the draws below the geometric mid-point 1e-4 (uniform would give ~9%)
    below = sum(v.overrides["ppo.lr"] < 1e-4 for v in a)
    assert 4 <= below <= 16


def test_variant_configs_apply_overrides_and_validate_every_variant():
    base = load_config(REPO / "conf" / "smoke.yaml")
    s = space(parameters={"ppo.kl_coef": [0.01, 0.3], "eval.n_prompts": [4]})
    configs = variant_configs(base, s)
    assert [c.ppo.kl_coef for _, c in configs] == [0.01, 0.3]
    assert [c.run_name for _, c in configs] == ["t-00", "t-01"]
    assert configs[0][1].sft == base.sft and configs[0][1].eval.n_prompts == 4
    with pytest.raises(ConfigError, match=r"variant 1 \(ppo.batch_size=3\): ppo.num_mini_batches \(2\) must divide"):
        variant_configs(base, space(parameters={"ppo.batch_size": [16, 3]}))
    with pytest.raises(ConfigError, match=r"ppo.kl_coef: Input should be greater than or equal to 0"):
        variant_config(base, s, expand(space(parameters={"ppo.kl_coef": [-1]}))[0])


@pytest.mark.parametrize("path", sorted((REPO / "conf" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_example_spaces_are_valid_on_the_default_config(path):
    space = load_space(path)
    base = load_config(REPO / "conf" / "default.yaml")
    configs = check_points(base, space) if space.method == "optuna" else VariantList(base, space).configs
    assert len(configs) >= 2


def test_optuna_space_errors_name_the_key():
    with pytest.raises(ConfigError, match="optuna.enqueue names 'ppo.lr', which is not one of the sweep's param"):
        space(method="optuna", parameters={"ppo.kl_coef": [0.1]}, optuna={"enqueue": [{"ppo.lr": 1e-4}]})
    with pytest.raises(ConfigError, match=r"parameters.ppo.stop_tokens: Optuna chooses among numbers, strings"):
        space(method="optuna", parameters={"ppo.stop_tokens": [["a"], ["b"]]})
    with pytest.raises(ConfigError, match="deployment 'pipeline' must be '<flow name>/<deployment name>'"):
        space(parameters={"ppo.kl_coef": [0.1]}, deployment="pipeline")
    base = load_config(REPO / "conf" / "smoke.yaml")
    # a pruner needs periodic evaluations: without ppo.eval_every, every tenth of training (here: every update)
    pruned = space(method="optuna", parameters={"ppo.kl_coef": {"low": 0.01, "high": 0.1}})
    assert base.ppo.eval_every == 0 and {c.ppo.eval_every for c in check_points(base, pruned)} == {1}
    unpruned = space(method="optuna", optuna={"pruner": "none"}, parameters={"ppo.kl_coef": [0.1]})
    assert {c.ppo.eval_every for c in check_points(base, unpruned)} == {0}
    with pytest.raises(ConfigError, match="ppo.num_mini_batches .* must divide"):
        check_points(base, space(method="optuna", optuna={"pruner": "none"}, parameters={"ppo.batch_size": [16, 3]}))


def test_optuna_search_asks_enqueued_points_first_and_tells_outcomes(tmp_path):
    from rlhf.sweeps.optuna_search import OptunaSearch

    base = load_config(REPO / "conf" / "smoke.yaml", ["ppo.eval_every=1"])
    raw = {
        "method": "optuna",
        "trials": 3,
        "parameters": {"ppo.kl_coef": {"low": 0.01, "high": 0.3, "log": True}, "ppo.num_ppo_epochs": [1, 2]},
        "optuna": {"enqueue": [{"ppo.kl_coef": 0.05, "ppo.num_ppo_epochs": 2}]},
    }
    storage = f"sqlite:///{tmp_path}/optuna.db"
    search = OptunaSearch(base, space(**raw), storage, "eval/policy_gold", "periodic_eval/gold")
    first = search.next()
    assert first.variant.overrides == {"ppo.kl_coef": 0.05, "ppo.num_ppo_epochs": 2}
    assert first.config.ppo.kl_coef == 0.05 and first.config.run_name == "t-00"
    assert first.trial.metric == "periodic_eval/gold" and first.trial.storage == storage
    search.tell(first, "completed", 0.5, "run-a")
    second = search.next()
    assert 0.01 <= second.variant.overrides["ppo.kl_coef"] <= 0.3
    search.tell(second, "pruned", None, "run-b")
    # a second start of the same sweep: the two finished trials are kept, one is left to run
    again = OptunaSearch(base, space(**raw), storage, "eval/policy_gold", "periodic_eval/gold")
    assert again.total == 1 and again.killed == []
    kept = again.kept()
    assert [(r["variant"], r["status"], r["mlflow_run_id"]) for r in kept] == [
        ("t-00", "completed", "run-a"),
        ("t-01", "pruned", "run-b"),
    ]
    third = again.next()
    assert third.variant.index == 2 and again.next() is None


def test_device_slots_one_per_gpu_or_virtual_cpu_slots():
    from flows.variants import device_slots

    # the sweep run's id in the names: two sweeps on one Prefect database never share (nor reset) a limit
    assert [tuple(s) for s in device_slots("cpu", 2, "ab12")] == [
        ("cpu", "rlhf-ab12-cpu-0"),
        ("cpu", "rlhf-ab12-cpu-1"),
    ]
    assert [tuple(s) for s in device_slots("cpu", 1, "cd34")] == [("cpu", "rlhf-cd34-cpu-0")]


def test_ranking_prefers_gold_reward_and_puts_failures_last():
    rows = [
        {"variant": "a", "ppo.kl_coef": 0.1, "eval/policy_gold": 0.2, "eval/policy_score": 3.0, "status": "completed"},
        {"variant": "b", "ppo.kl_coef": 0.2, "status": "failed"},
        {"variant": "c", "ppo.kl_coef": 0.3, "eval/policy_gold": 0.5, "eval/policy_score": 1.0, "status": "completed"},
    ]
    table = ranking(rows, ["ppo.kl_coef"])
    assert list(table["variant"]) == ["c", "a", "b"]
    assert list(table["rank"]) == [1, 2, 3]
    assert list(table.columns[:5]) == ["rank", "variant", "ppo.kl_coef", "eval/policy_gold", "eval/kl"]  # KL in view
    no_gold = [{**r, "eval/policy_gold": None} for r in rows]
    by_score = ranking(no_gold, ["ppo.kl_coef"])
    assert list(by_score["variant"]) == ["a", "c", "b"] and list(by_score.columns[3:5]) == [
        "eval/policy_score",
        "eval/kl",
    ]


# -- The sweep flow on a real (tiny) pipeline --------------------------------------------------------------------


def _subflow_task_states(parent_flow_run_id, run_counts: bool = False) -> dict[str, dict[str, str]]:
    """{subflow run name: {task name: state name (or with `run_counts`, how often it ran)}} of a sweep's variants."""
    return {
        sub.name: {stage_name(t): t.run_count if run_counts else t.state.name for t in task_runs(sub.id)}
        for sub in subflow_runs(parent_flow_run_id)
    }


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    """One output folder and MLflow store for the sweep tests, so later sweeps reuse the stages of earlier ones."""
    return tmp_path_factory.mktemp("sweeps")


def tiny_base(folder, *overrides):
    uri = f"sqlite:///{folder}/mlflow.db"
    tracking = [f"tracking.uri={uri}", f"tracking.artifact_location={folder}/art", f"runtime.output_dir={folder}"]
    return uri, load_config(REPO / "conf" / "smoke.yaml", [*TINY, *tracking, *overrides])


@pytest.mark.xdist_group("sweep")  # one worker runs both sweeps: one harness, and the second reuses the first's stages
def test_sweep_flow_runs_two_variants_at_once_builds_shared_stages_once_and_ranks(harness, sweep_dir):
    """Two variants on two CPU slots at the same time; data, SFT and reward model built once by the sweep itself."""
    from flows.sweep import rlhf_sweep

    tmp_path = sweep_dir
    uri, base = tiny_base(tmp_path)
    s = space(parameters={"ppo.kl_coef": [0.02, 0.2]}, max_concurrency=2)
    state = rlhf_sweep(base, s, return_state=True)
    result = state.result()

    table = result["ranking"]
    assert [row["status"] for row in table] == ["completed", "completed"]
    assert sorted(row["ppo.kl_coef"] for row in table) == [0.02, 0.2]
    assert all(row["eval/kl"] is not None for row in table)

    # the shared stages: built by the sweep (children of its MLflow run), then taken from the cache by both variants
    sweep_flow_run = state.state_details.flow_run_id
    built = [stage_name(t) for t in task_runs(sweep_flow_run) if t.state.name == "Completed"]
    assert {"prepare_preferences", "supervised_finetune", "train_reward_model"} <= set(built)
    states = _subflow_task_states(sweep_flow_run)
    assert set(states) == {"t-00", "t-01"}
    for name in states:
        for stage in ("prepare_preferences", "supervised_finetune", "train_reward_model"):
            assert states[name][stage] == "Cached", (stage, states[name])
        assert states[name]["train_policy_ppo"] == "Completed"
    assert "sweep-t" in {a.key for a in flow_run_artifacts(sweep_flow_run)}

    client = MlflowClient(uri)
    sweep_run = client.get_run(result["sweep_run_id"])
    assert sweep_run.info.run_name == "sweep-t" and sweep_run.info.status == "FINISHED"
    assert sweep_run.data.tags["run_type"] == "sweep"
    assert sweep_run.data.tags["sweep.best_run_id"] == table[0]["mlflow_run_id"]
    assert sorted(m.step for m in client.get_metric_history(sweep_run.info.run_id, "eval/kl")) == [0, 1]
    assert {"sweep_ranking.json", "reward_vs_kl.png", "ranking.csv"} <= {
        a.path for a in client.list_artifacts(sweep_run.info.run_id)
    }
    shared = child_stage_runs(client, sweep_run.info.run_id, "train_reward_model")
    assert len(shared) == 1 and shared[0].info.status == "FINISHED"
    ppo = []
    for row in table:
        variant = client.get_run(row["mlflow_run_id"])
        assert variant.data.tags["sweep_run_id"] == sweep_run.info.run_id
        assert variant.data.tags["mlflow.parentRunId"] == sweep_run.info.run_id
        assert variant.data.params["ppo.kl_coef"] == str(row["ppo.kl_coef"])
        assert variant.data.params["runtime.device"] == "cpu"
        (stage_run,) = child_stage_runs(client, row["mlflow_run_id"], "train_policy_ppo")
        ppo.append((variant.data.params["runtime.device_slot"], variant.data.params["runtime.threads"]))
    # each variant held its own slot (a Prefect concurrency limit of one slot): the sweep hands out the second slot
    # only while the first variant still runs (sequential variants would share rlhf-cpu-0), and each got its share of
    # the cores. Wall-clock overlap of the two subflows is not asserted: on a loaded 2-core CI machine the first
    # tiny variant can finish before the second thread's subflow is scheduled.
    share = str(max(1, (os.cpu_count() or 1) // 2))
    owner = sweep_run.info.run_id[:8]  # the sweep's own limits, removed at its end
    assert sorted(ppo) == [(f"rlhf-{owner}-cpu-0", share), (f"rlhf-{owner}-cpu-1", share)]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        assert not [limit.name for limit in prefect.read_global_concurrency_limits() if owner in limit.name]
    assert (tmp_path / "sweeps").is_dir() and open(result["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def child_stage_runs(client: MlflowClient, parent_run_id: str, stage: str):
    experiment = client.get_experiment_by_name("rlhf-ppo").experiment_id
    query = f"tags.`mlflow.parentRunId` = '{parent_run_id}' AND tags.stage = '{stage}'"
    return client.search_runs([experiment], query)


@pytest.mark.xdist_group("sweep")
def test_a_failed_variant_is_ranked_last_with_its_error_and_the_others_complete(harness, sweep_dir):
    """A stop token that is several tokens for the policy's tokenizer: known only once the tokenizer is loaded, so
    the variant fails at PPO (once: a config error is not retried); the sweep goes on and reports it. Started from
    the sweep's short form (a shipped config with overrides, a space file with an override), as the UI does."""
    from flows.form import PipelineRun, SweepRun, rlhf_sweep_run

    uri, base = tiny_base(sweep_dir, "ppo.kl_coef=0.02")  # f-00 is t-00 of the sweep above: cached if it ran
    where = [f"tracking.uri={uri}", f"tracking.artifact_location={sweep_dir}/art", f"runtime.output_dir={sweep_dir}"]
    sizes = {"ppo_total_episodes": 32, "ppo_batch_size": 16}  # TINY's, in the form's typed fields
    form_base = PipelineRun(config_file="conf/smoke.yaml", **sizes, overrides=[*TINY[2:], *where, "ppo.kl_coef=0.02"])
    assert form_base.config() == base
    space_file = sweep_dir / "f.yaml"
    space_file.write_text("name: f\nparameters:\n  ppo.stop_tokens: [[]]\n")
    run = SweepRun(
        base=form_base,
        space_path=str(space_file),
        space_overrides=["parameters.ppo.stop_tokens=[[], ['not one token at all']]"],
    )
    state = rlhf_sweep_run(run, return_state=True)
    table = state.result()["ranking"]

    assert [(row["variant"], row["status"]) for row in table] == [("f-00", "completed"), ("f-01", "failed")]
    assert "ppo.stop_tokens: 'not one token at all' is" in table[1]["error"]
    states = _subflow_task_states(state.state_details.flow_run_id)
    assert states["f-01"]["train_reward_model"] == "Cached"  # reused from f-00 (or from the sweep above)
    assert states["f-01"]["train_policy_ppo"] == "Failed"
    runs = _subflow_task_states(state.state_details.flow_run_id, run_counts=True)
    assert runs["f-01"]["train_policy_ppo"] == 1  # a bad config is not retried (a crash would run 3 times)

    client = MlflowClient(uri)
    sweep_run = client.get_run(state.result()["sweep_run_id"])
    assert sweep_run.info.status == "FINISHED" and sweep_run.data.tags["sweep.best_variant"] == "f-00"
    failed = client.get_run(table[1]["mlflow_run_id"])
    assert failed.info.status == "FAILED"
    assert failed.data.tags["mlflow.parentRunId"] == sweep_run.info.run_id


def test_cli_rejects_a_bad_space_before_running(tmp_path, capsys):
    from flows.sweep_command import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nparameters:\n  ppo.kl_cof: [0.1]\n")
    assert main(["--config", str(REPO / "conf" / "smoke.yaml"), "--space", str(bad)]) == 2
    assert "parameters.ppo.kl_cof is not a config key" in capsys.readouterr().err


@pytest.mark.xdist_group("sweep")
def test_two_arm_one_seed_study_tabulates_and_plots(harness, sweep_dir, tmp_path, capsys):
    """GRPO beside DPO, one seed, on the sweep tests' store: both arms take data, SFT and reward model from the
    cache; the study table and the frontier are logged on the sweep run and published as a Prefect table."""
    import pandas as pd

    from flows.sweep import rlhf_sweep

    uri, base = tiny_base(sweep_dir)
    s = parse_space(
        {
            "name": "study",
            "arms": [
                {"name": "GRPO", "overrides": {"ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 4,
                                               "ppo.eval_every": 1, "ppo.eval_n_prompts": 8}},
                {"name": "DPO", "overrides": {"algorithm": "dpo", "dpo.lr": 1e-3, "dpo.batch_size": 32}},
            ],
            "parameters": {"policy_seed": [3]},
        }
    )  # fmt: skip
    state = rlhf_sweep(base, s, return_state=True)
    result = state.result()
    assert [row["status"] for row in result["ranking"]] == ["completed", "completed"]

    sweep_flow_run = state.state_details.flow_run_id
    shared = ["prepare_preferences", "supervised_finetune", "train_reward_model"]
    for sub in subflow_runs(sweep_flow_run):  # each arm takes the shared stages from the cache
        states = {stage_name(t): t.state.name for t in task_runs(sub.id)}
        assert {states[name] for name in shared} == {"Cached"}
    assert "sweep-study-study" in {a.key for a in flow_run_artifacts(sweep_flow_run)}

    client = MlflowClient(uri)
    run_id = result["sweep_run_id"]
    files = {a.path for a in client.list_artifacts(run_id)}
    assert {"study_table.json", "study_table.csv", "study_table.md", "frontier.png", "frontier_points.csv"} <= files
    # the variants' budget makes them plumbing checks: the study's table, its Prefect table and the sweep's MLflow
    # run say so first
    markdown = Path(client.download_artifacts(run_id, "study_table.md", str(tmp_path))).read_text()
    assert markdown.startswith("NOTE: every variant whose budget is this small is a plumbing check, not learning")
    assert client.get_run(run_id).data.tags["mlflow.note.content"].startswith("NOTE: every variant")
    (study,) = [a for a in flow_run_artifacts(sweep_flow_run) if a.key == "sweep-study-study"]
    assert study.description.startswith("NOTE: every variant")
    (ranking,) = [a for a in flow_run_artifacts(sweep_flow_run) if a.key == "sweep-study"]
    assert study.task_run_id is None and ranking.task_run_id is None  # both filed under the sweep's flow run
    assert list(json.loads(study.data)[0])[:4] == ["arm", "runs", "win rate", "KL"]
    # the ranking in words, narrow (the full table one link away: every metric by its MLflow key)
    short = json.loads(ranking.data)
    assert sorted(row["variant"].split(",")[0] for row in short) == ["DPO", "GRPO"]
    assert list(short[0]) == ["rank", "variant", "gold reward (ranked by)", "beats SFT (gold)", "KL to SFT", "status"]
    assert "/artifacts/artifact/" in ranking.description or "sweep-study-full" in ranking.description
    (full,) = [a for a in flow_run_artifacts(sweep_flow_run) if a.key == "sweep-study-full"]
    assert "eval/kl" in json.loads(full.data)[0]
    (compare,) = [a for a in flow_run_artifacts(sweep_flow_run) if a.key == "sweep-study-mlflow-compare"]
    assert "#/compare-runs?runs=" in compare.data and "workflowType=machine_learning" in compare.data
    table = client.download_artifacts(run_id, "study_table.csv", str(tmp_path))
    frame = pd.read_csv(table)
    assert list(frame["arm"]) == ["GRPO", "DPO"] and list(frame["runs"]) == ["1/1", "1/1"]
    assert frame["win_rate_gold"].notna().all() and frame["kl"].notna().all() and frame["train_s"].gt(0).all()
    points = pd.read_csv(client.download_artifacts(run_id, "frontier_points.csv", str(tmp_path)))
    grpo = points[points["arm"] == "GRPO"]
    assert (grpo["kind"] == "periodic").sum() >= 2 and (points["kind"] == "final").sum() == 2
    # make compare prints the newest study, its table and where its frontier plot was written
    from rlhf.sweeps.compare import main as compare_main

    assert compare_main(["--tracking-uri", uri, "--out", str(tmp_path / "compare"), "--last", "2"]) == 0
    printed = capsys.readouterr().out
    assert (
        "the same runs side by side in MLflow (make mlflow-ui): http" in printed and "workflowType=machine" in printed
    )
    assert "== Study study: per arm, mean and 95% interval" in printed and "| GRPO | 1/1 |" in printed
    assert (tmp_path / "compare" / "frontier.png").is_file()
    # the policy stage ran with the arm's seed, not the global one
    for row in result["ranking"]:
        stage = "train_policy_dpo" if row["arm"] == "DPO" else "train_policy_ppo"
        experiment = client.get_experiment_by_name("rlhf-ppo").experiment_id
        query = f"tags.`mlflow.parentRunId` = '{row['mlflow_run_id']}' AND tags.stage = '{stage}'"
        (stage_run,) = client.search_runs([experiment], query)
        assert stage_run.data.params["seed"] == "3"


def test_the_short_ranking_is_in_words_and_narrow():
    """The sweep's ranking as the Prefect UI shows it: six columns in words (not 19 metric keys), the variant by its
    arm and swept values, the reward it is ranked by; a failed variant's error on one line."""
    from flows.artifacts import short_ranking
    from rlhf.sweeps.ranking import ranking

    rows = [
        {"variant": "s-00", "arm": "GRPO", "ppo.kl_coef": 0.1, "status": "completed", "mlflow_run_id": "a"}
        | {"eval/policy_score": 0.2, "eval/win_rate_rm": 0.6, "eval/kl": 1.5},
        {"variant": "s-01", "arm": "PPO", "ppo.kl_coef": 0.2, "status": "failed", "error": "out of\nmemory"},
    ]
    short = short_ranking(ranking(rows, ["arm", "ppo.kl_coef"]).to_dict("records"))
    assert short[0] == {
        "rank": 1,
        "variant": "GRPO, kl_coef=0.1",
        "reward-model score (ranked by)": 0.2,
        "beats SFT (reward model)": 0.6,
        "KL to SFT": 1.5,
        "status": "completed",
    }
    assert short[1]["variant"] == "PPO, kl_coef=0.2" and short[1]["error"] == "out of memory"


@pytest.mark.xdist_group("sweep")
def test_a_stage_waiting_for_its_device_slot_stops_when_the_command_does(harness, caplog):
    # a sweep's variants wait for their device slot in worker threads, which Ctrl-C does not interrupt: the wait
    # looks every SLOT_POLL_S whether the command was stopped, and says once that it waits
    import threading

    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    from rlhf.errors import StopRequested
    from rlhf.stop_request import clear_stop_request, request_stop
    from tasks.caching import SLOT_POLL_S, device_slot

    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name("rlhf-test-slot", 1)
    outcome: list[object] = []

    def wait() -> None:
        try:
            with device_slot("rlhf-test-slot", "train_policy_ppo"):
                outcome.append("held")
        except BaseException as err:  # noqa: BLE001 (the test reads it)
            outcome.append(err)

    caplog.set_level("INFO", logger="tasks.progress")
    try:
        with concurrency("rlhf-test-slot", occupy=1):  # another stage holds the slot
            worker = threading.Thread(target=wait)
            worker.start()
            worker.join(SLOT_POLL_S + 1)  # still waiting: the slot is held
            assert worker.is_alive() and not outcome
            request_stop()
            worker.join(4 * SLOT_POLL_S)
    finally:
        clear_stop_request()
    assert len(outcome) == 1 and isinstance(outcome[0], StopRequested), outcome
    assert "train_policy_ppo, waiting for the device slot rlhf-test-slot" in str(outcome[0])
    assert "train_policy_ppo waits for the device slot rlhf-test-slot: another stage holds it" in caplog.text
    with device_slot("rlhf-test-slot"):  # free again: taken at once
        pass
