"""Sweeps that fan out beyond one process: variants as flow runs of a deployment picked up by real `prefect worker`
processes, and an Optuna sweep killed and resumed, with pruning. (Concurrent variants on one machine:
tests/test_sweep.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from rlhf.config import load_config
from rlhf.sweeps.space import parse_space
from tests.conftest import REPO, drain_prefect_services, seed_prefect_home, stage_name, subflow_runs, task_runs

TINY = ["ppo.total_episodes=32", "ppo.batch_size=16", "eval.n_prompts=8", "eval.batch_size=8"]

pytestmark = [pytest.mark.slow, pytest.mark.long]


def tiny_base(folder, *overrides):
    uri = f"sqlite:///{folder}/mlflow.db"
    tracking = [f"tracking.uri={uri}", f"tracking.artifact_location={folder}/art", f"runtime.output_dir={folder}"]
    return uri, load_config(REPO / "conf" / "smoke.yaml", [*TINY, *tracking, *overrides])


def test_variants_as_flow_runs_of_a_deployment_are_picked_up_by_two_process_workers(tmp_path_factory):
    """A real `prefect server`, the pipeline deployment of prefect.yaml on a process work pool, two `prefect worker`
    processes (one flow run each at a time): the sweep's two variants run on both workers at once and are ranked."""
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    from flows.sweep import rlhf_sweep
    from tests.test_ui_server import BIN, prefect_server, request, start, stop, wait_until

    server = prefect_server.__wrapped__(tmp_path_factory)  # the module fixture of test_ui_server, as a generator
    api, env, tmp = next(server)
    workers = []
    try:
        storage = tmp / "results"  # Prefect's result store (the stage cache): shared by the sweep and the workers
        env = {**env, "PREFECT_LOCAL_STORAGE_PATH": str(storage), "PYTHONPATH": str(REPO)}
        pool = request("POST", f"{api}/work_pools/", json={"name": "rlhf-local", "type": "process"})
        assert pool.status_code == 201, pool.text
        deploy = [str(BIN / "prefect"), "--no-prompt", "deploy", "--name", "rlhf-pipeline/run-pipeline-every-setting"]
        done = subprocess.run(deploy, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        for name in ("w1", "w2"):
            log = tmp / f"{name}.log"
            cmd = [str(BIN / "prefect"), "worker", "start", "--pool", "rlhf-local", "--limit", "1", "--name", name]
            workers.append((name, start(cmd, env, log), log))
        for name, proc, log in workers:
            wait_until(lambda log=log: "started!" in log.read_text(errors="replace"), 120, f"{name} start", proc, log)

        uri, base = tiny_base(tmp / "sweep")
        space = parse_space(
            {
                "name": "pool",
                "deployment": "rlhf-pipeline/run-pipeline-every-setting",
                "max_concurrency": 2,
                "parameters": {"ppo.kl_coef": [0.02, 0.2]},
            }
        )
        with temporary_settings(updates={PREFECT_API_URL: api, PREFECT_LOCAL_STORAGE_PATH: storage}):
            try:
                state = rlhf_sweep(base, space, return_state=True)
                table = state.result()["ranking"]
                variants = subflow_runs(state.state_details.flow_run_id)
                stage_states = {v.name: {stage_name(t): t.state.name for t in task_runs(v.id)} for v in variants}
            finally:
                drain_prefect_services()
        assert [row["status"] for row in table] == ["completed", "completed"], table
        assert all(row["eval/policy_gold"] is not None for row in table)
        assert sorted(v.name for v in variants) == ["pool-00", "pool-01"]
        assert {v.work_pool_name for v in variants} == {"rlhf-local"}
        for states in stage_states.values():  # the shared stages came from the sweep's cache
            assert states["train_reward_model"] == "Cached" and states["train_policy_ppo"] == "Completed", states
        ran_on = {name for name, _, log in workers for v in variants if str(v.id) in log.read_text(errors="replace")}
        assert ran_on == {"w1", "w2"}, "each worker ran one variant"
        client = MlflowClient(uri)
        for row in table:  # each variant's pipeline run, finished, names the worker's flow run it ran in
            run = client.get_run(row["mlflow_run_id"])
            assert run.data.tags["sweep_run_id"] == state.result()["sweep_run_id"]
            assert run.info.status == "FINISHED"
            assert run.data.tags["prefect.flow_run_id"] in {str(v.id) for v in variants}
    finally:
        for _, proc, _ in workers:
            stop(proc)
        server.close()


def test_optuna_sweep_killed_after_its_first_trial_resumes_it_and_prunes_a_bad_region(tmp_path, shared_prefect_api):
    """`rlhf sweep` of an Optuna space, SIGKILLed once its first trial is complete; started again, it keeps that
    trial (not re-run), asks the killed trial's point again, and the median pruner stops the trial in the
    deliberately bad region (sampling temperature 3: word salad) at its first periodic evaluation."""
    import optuna
    import yaml

    from rlhf.sweeps.optuna_search import trial_point
    from tests.test_process_faults import finish, kill_when

    storage = f"sqlite:///{tmp_path}/optuna.db"
    good_a, good_b, bad = ({"ppo.kl_coef": k, "ppo.temperature": t} for k, t in ((0.02, 0.7), (0.2, 0.7), (0.02, 3.0)))
    space = {
        "name": "opt",
        "method": "optuna",
        "trials": 3,
        "max_concurrency": 1,
        "parameters": {"ppo.kl_coef": [0.02, 0.2], "ppo.temperature": [0.7, 3.0]},
        "optuna": {"pruner": "median", "n_startup_trials": 1, "storage": storage, "enqueue": [good_a, good_b, bad]},
    }
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [sys.executable, "-m", "flows.sweep", "--config", "conf/smoke.yaml", "--space", str(tmp_path / "space.yaml")]
    args += [*TINY, f"tracking.uri={uri}", f"tracking.artifact_location={tmp_path}/art"]
    args += [
        f"runtime.output_dir={tmp_path}/out",
        "sft.steps=120",
        "sft.warmup_ratio=0.25",
        "ppo.eval_every=1",
        "ppo.eval_n_prompts=16",
    ]
    env = {**os.environ, "PREFECT_HOME": seed_prefect_home(tmp_path / "prefect"), "PYTHONUNBUFFERED": "1"}
    env["PREFECT_API_URL"] = shared_prefect_api  # Prefect in passing: no temporary server for each attempt

    def run(name: str):
        log = tmp_path / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return proc, log

    def trials(state) -> list:
        try:
            study = optuna.load_study(study_name="opt", storage=storage)
        except KeyError:  # not created yet
            return []
        return study.get_trials(states=(state,))

    def second_trial_started() -> bool:  # one snapshot: the first trial is complete, the second has its variant's name
        try:
            snapshot = optuna.load_study(study_name="opt", storage=storage).trials
        except KeyError:  # not created yet
            return False
        states = [t.state for t in snapshot]
        return (
            len(snapshot) >= 2
            and states[0] == optuna.trial.TrialState.COMPLETE
            and (states[1] == optuna.trial.TrialState.RUNNING and "run_name" in snapshot[1].user_attrs)
        )

    first, _ = run("first")
    kill_when(first, second_trial_started, timeout=600)
    (kept,) = trials(optuna.trial.TrialState.COMPLETE)
    assert kept.params == good_a

    second, log = run("second")
    output = finish(second, log, timeout=600)
    study = optuna.load_study(study_name="opt", storage=storage)
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    complete, pruned, failed = ([t for t in study.trials if t.state == s] for s in states)
    # the first trial is kept as it was; the killed one is marked failed and its point asked again
    assert [(t.number, t.value, t.datetime_complete) for t in complete][0] == (
        kept.number,
        kept.value,
        kept.datetime_complete,
    )
    assert [t.params for t in complete] == [good_a, good_b]
    assert len(failed) == 1 and trial_point(failed[0]) == good_b and failed[0].user_attrs["rlhf.killed"]
    # the bad region: pruned at the first periodic evaluation (PPO update 0 of 2), below the median gold reward
    assert len(pruned) == 1 and pruned[0].params == bad
    assert max(pruned[0].intermediate_values) == 0
    assert pruned[0].intermediate_values[0] < kept.intermediate_values[0]

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("rlhf-ppo").experiment_id
    pipeline_runs = client.search_runs([experiment], "tags.`sweep.study` = 'opt'")
    names = sorted(r.info.run_name for r in pipeline_runs)
    assert names.count(kept.user_attrs["run_name"]) == 1, names  # the kept trial was not run again
    pruned_run = client.get_run(pruned[0].user_attrs["mlflow_run_id"])
    assert pruned_run.info.status == "KILLED" and pruned_run.data.tags["sweep.pruned"] == "true"
    (sweep_run,) = client.search_runs([experiment], "tags.run_type = 'sweep'")  # one sweep run, reopened
    assert sweep_run.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(sweep_run.info.run_id)}
    assert {"optuna_history.png", "sweep_ranking.json", "overoptimisation.png"} <= artifacts  # ppo.eval_every: on
    ranking = output[output.index("== Sweep ranking") :]
    assert ranking.count("completed") == 2 and ranking.count("pruned") == 1, ranking
