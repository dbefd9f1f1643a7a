"""`make ui-check`: the Prefect and MLflow UIs checked in a real (headless) browser.

Starts `make ui` (conf/smoke.yaml as the forms' default, free ports, its own Prefect home and MLflow store under
outputs/ui-check/), opens the short run form of ``rlhf-run/run-pipeline`` in headless Chromium, starts a small run with
the form's parameters, waits for it, and writes screenshots to outputs/ui-check/:

    01-prefect-form.png        the deployment's run form (config drop-down, PPO batch fields, overrides)
    01b-prefect-form-refused.png  the form after Submit with ppo.num_mini_batches 3 (smoke's batch_size is 16): the
                               error on the field says what it expects ('a divisor of ppo.batch_size (16 in
                               conf/smoke.yaml): 1, 2, 4, 8 or 16' was expected), and no flow run is created
    01d-prefect-form-group-refused.png  the same with ppo.samples_per_prompt 3: the batch size it must divide
    01c-prefect-sweep-form.png the sweep's short form (``rlhf-sweep-run/run-sweep``): the base as the run form takes
                               it, a drop-down of conf/sweeps/ with the runs each space starts, overrides of the
                               space; its page height is printed
    01e-prefect-deployments.png  the Deployments page: four names that say what each does
    02-prefect-run.png         the finished flow run (task graph and states)
    03-prefect-artifacts.png   its Artifacts tab (progress bars, evaluation table, MLflow link)
    02b-prefect-run-logs.png   its Logs tab, ending with the summary the terminal prints (win rates, KL, the alarm)
    03b-prefect-evaluation.png the evaluation: the NOTE, the summary's lines in words (the alarm's among them), the
                               stages with their MLflow runs
    03c-prefect-mlflow-link.png  the MLflow link artifact (its text without a literal '&amp;')
    04-mlflow-experiment.png   the experiment in the project's saved view (columns: win rates, KL, RM accuracy, key
                               parameters), as the links the project writes open it
    04b-mlflow-experiment-charts.png  the same view's charts: the PPO sections first
    05-mlflow-run.png          the pipeline's MLflow run (the page the Prefect link opens): its description the NOTE
    06-mlflow-ppo-run.png      the PPO stage's MLflow run, its `objective/` charts (score, KL, gold score, ...)
    09-mlflow-home-experiment-new-browser.png  MLflow's home -> rlhf-ppo in a browser that never chose a view
                               (MLflow 3.17: GenAI)
    09b-mlflow-home-experiment.png, 09c-mlflow-native-compare.png  the same path and MLflow's own Compare page after
                               the user's one step, the side bar's Model training: the model-training navigation
    07-prefect-sweep-artifacts.png  a two-arm study started from the sweep form: its flow run's Artifacts tab, the
                               ranking and the study table both on the flow run
    07b-prefect-sweep-ranking.png, 07c-prefect-study-table.png  the two tables, the KL column in view
    08-mlflow-sweep-run.png    the study's MLflow run (its description the NOTE)
    08b-mlflow-study-table.png its study_table.md artifact
    03d-prefect-evaluation-1440.png, 07b-...-1440.png, 07c-...-1440.png  the evaluation, the ranking and the study
                               table in a window 1440 pixels wide: none may need horizontal scrolling

While that run and a second one train it submits the form 10 times (`--submits`) through the API call the form
makes, each once: all must be created (they failed with 503 while runs wrote; flows/prefect_server.py), with their
median and 95th percentile times printed. It also asserts what the user reads, through the UI's own API (the form's
validation, the flow run's logs and artifacts, the MLflow runs): the plumbing check's NOTE in the log, the
evaluation table and the MLflow run's description; the compare links' ``workflowType=machine_learning``; the form's
error text (the grpo rule through the validation endpoint the form calls); distinct deployment names; the sweep
form's space sizes. Last, it starts a long run, stops `make ui` with SIGINT (Ctrl-C) while the run trains, and
checks that what the run's process prints after the signal has no traceback, that its MLflow runs end KILLED and
that Prefect records the flow run Cancelled, not Crashed (``ctrl-c.log``: what was printed). The browser's helpers
are in tools/ui_browser.py, the forms' checks in tools/ui_check_forms.py, the MLflow checks in
tools/ui_check_mlflow.py.

Needs Debian's chromium and chromium-driver (``apt-get install -y chromium chromium-driver``) and selenium (the
make target installs it into .venv). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prefect_rest import (
    artifacts_of,
    deployment,
    free_port,
    logs_of,
    start_run,
    submit_repeatedly,
    training,
    wait_for,
    wait_run,
)
from ui_browser import REPO, Checks, browser, overflow, page_text, shoot
from ui_check_forms import check_forms
from ui_check_mlflow import check_mlflow, check_mlflow_navigation

NOTE = "NOTE: a plumbing check, not learning"
SWEEP_NOTE = "NOTE: every variant whose budget is this small is a plumbing check"
VIEW = "workflowType=machine_learning"
# what the terminal prints at the end of a run, in the browser too: the summary's title, the win rates, the KL and
# the over-optimisation alarm's line
SUMMARY_LINES = (
    "== RLHF pipeline summary",
    "PPO beats SFT on gold reward",
    "mean KL(PPO || SFT) per response",
    "over-optimisation alarm (no gold)",
)
# a study of two arms, one seed, on the smoke config: started from the sweep form's fields
STUDY_RUN = {
    "space_file": "conf/sweeps/algorithms.yaml",
    "space_overrides": [
        "arms=[{name: PPO, overrides: {ppo.advantage_estimator: gae}}, "
        "{name: GRPO, overrides: {ppo.advantage_estimator: grpo, ppo.samples_per_prompt: 2}}]",
        "parameters.policy_seed=[0]",
    ],
}


def check_pipeline_run(driver, api: str, ui_url: str, flow_run_id: str, out: Path, check: Checks) -> None:
    """A plumbing check's NOTE in the flow run's log and its evaluation table; the compare link's view; the MLflow
    link's text."""
    check(any(m.startswith(NOTE) for m in logs_of(api, flow_run_id)), f"the flow run's log says {NOTE!r}")
    # the summary the terminal prints, at the end of the Logs tab in the browser
    shoot(driver, f"{ui_url}/runs/flow-run/{flow_run_id}", out / "02b-prefect-run-logs.png", tab="Logs")
    logs_tab = page_text(driver)
    for line in SUMMARY_LINES:
        check(line in logs_tab, f"the Logs tab in the browser shows {line!r}")
    found = artifacts_of(api, flow_run_id)
    evaluation, link = found.get("rlhf-evaluation", {}), found.get("rlhf-mlflow-run", {})
    check((evaluation.get("description") or "").startswith(NOTE), f"the evaluation table's description opens {NOTE!r}")
    if evaluation:
        shoot(driver, f"{ui_url}/artifacts/artifact/{evaluation['id']}", out / "03b-prefect-evaluation.png")
        shown = page_text(driver)
        for line in SUMMARY_LINES[1:]:
            check(line in shown, f"the evaluation artifact in the browser shows {line!r}")
        check("eval/" not in shown, "the evaluation artifact shows words, not metric keys")
        check(
            fits(driver, f"{ui_url}/artifacts/artifact/{evaluation['id']}", out / "03d-prefect-evaluation-1440.png"),
            "the evaluation artifact fits 1440 pixels: no horizontal scrolling",
        )
    if link:
        shoot(driver, f"{ui_url}/artifacts/artifact/{link['id']}", out / "03c-prefect-mlflow-link.png")
        check("&amp;" not in page_text(driver), "the MLflow link artifact shows no literal '&amp;'")


def check_study(driver, api: str, ui_url: str, mlflow_url: str, flow_run_id: str, out: Path, check: Checks) -> None:
    """The study's ranking and study tables on its flow run (not a task run's), each opening with the NOTE, the KL
    column in view; the compare link's view; the MLflow sweep run's description."""
    found = artifacts_of(api, flow_run_id)
    ranking, study = found.get("sweep-algorithms", {}), found.get("sweep-algorithms-study", {})
    compare = found.get("sweep-algorithms-mlflow-compare", {})
    for name, table in (("ranking", ranking), ("study", study)):
        check(bool(table) and table.get("task_run_id") is None, f"the {name} table is filed under the flow run")
        check((table.get("description") or "").startswith(SWEEP_NOTE), f"the {name} table opens with the NOTE")
    check(VIEW in (compare.get("data") or ""), f"the sweep's compare link has {VIEW}")
    shoot(driver, f"{ui_url}/runs/flow-run/{flow_run_id}", out / "07-prefect-sweep-artifacts.png", tab="Artifacts")
    for table, name in ((ranking, "07b-prefect-sweep-ranking.png"), (study, "07c-prefect-study-table.png")):
        if table:
            shoot(driver, f"{ui_url}/artifacts/artifact/{table['id']}", out / name)
            check("KL" in page_text(driver), f"{name}: a KL column")
            check(
                fits(driver, f"{ui_url}/artifacts/artifact/{table['id']}", out / name.replace(".png", "-1440.png")),
                f"{name}: the table fits 1440 pixels, no horizontal scrolling",
            )
    check("sweep-algorithms-full" in found, "the ranking's full table is there (its link in the short one's text)")
    check("&amp;" not in json.dumps(ranking), "no literal '&amp;' in the ranking's text")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{REPO}/mlruns/mlflow.db")
    exp = client.get_experiment_by_name("rlhf-ppo").experiment_id
    (run,) = client.search_runs(
        [exp], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.run_type = 'sweep'"
    )
    check(run.data.tags.get("mlflow.note.content", "").startswith(SWEEP_NOTE), "the MLflow sweep run's description")
    # the GRPO arm is called GRPO: its MLflow run's objective (a column of the saved view) and its Prefect log
    variants = client.search_runs([exp], filter_string=f"tags.sweep_run_id = '{run.info.run_id}'")
    grpo = [v for v in variants if v.data.tags.get("rlhf.objective_label") == "GRPO"]
    objectives = [v.data.tags.get("rlhf.objective_label") for v in variants]
    check(len(grpo) == 1, f"one variant's objective is GRPO: {objectives}")
    if grpo:
        said = logs_of(api, grpo[0].data.tags.get("prefect.flow_run_id", ""))
        check(
            any(m.startswith("GRPO step ") for m in said) and not any(m.startswith("ppo step") for m in said),
            "the GRPO variant's Prefect log says 'GRPO step', never 'ppo step'",
        )
    url = f"{mlflow_url}/#/experiments/{exp}/runs/{run.info.run_id}"
    shoot(driver, f"{url}?{VIEW}", out / "08-mlflow-sweep-run.png")
    shoot(driver, f"{url}/artifacts/study_table.md?{VIEW}", out / "08b-mlflow-study-table.png", 8)


def stored_state(home: Path, flow_run_id: str) -> tuple[str, str]:
    """A flow run's state type and message in the SQLite database of the Prefect server that had `home`."""
    import sqlite3

    for path in home.glob("*.db"):
        with sqlite3.connect(path) as db:
            found = db.execute("select state_type, state_name from flow_run where id = ?", (flow_run_id,)).fetchone()
        if found:
            return str(found[0]).rsplit(".", 1)[-1], str(found[1])
    return "not found", str(list(home.glob("*.db")))


def fits(driver, url: str, path: Path) -> bool:
    """The page at 1440 pixels wide (a laptop's screen): its tables need no horizontal scrolling."""
    driver.set_window_size(1440, 1000)
    try:
        shoot(driver, url, path)
        wider = overflow(driver)
        print(f"ui-check: {path.name}: {wider} pixels wider than the window", flush=True)
        return wider == 0
    finally:
        driver.set_window_size(1920, 1200)


def check_ctrl_c(ui: subprocess.Popen, api: str, form_id: str, log_path: Path, out: Path, check: Checks) -> None:
    """Start a long run, stop `make ui` with SIGINT (Ctrl-C reaches make and `rlhf ui`) once a stage's MLflow run is
    open: what is printed after the signal has no traceback, and the run's MLflow runs end KILLED."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{REPO}/mlruns/mlflow.db")
    exp = client.get_experiment_by_name("rlhf-ppo").experiment_id
    run = {"config_file": "conf/smoke.yaml", "ppo_total_episodes": 3200, "overrides": ["ppo.kl_coef=0.3"]}
    flow_run_id = start_run(api, form_id, run)

    def training():
        runs = client.search_runs([exp], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
        return any(r.data.tags.get("stage") == "train_policy_ppo" and r.info.status == "RUNNING" for r in runs)

    wait_for(training, 300, "the PPO stage's MLflow run")
    time.sleep(5.0)
    mark = log_path.stat().st_size
    os.killpg(ui.pid, signal.SIGINT)  # as Ctrl-C in the terminal: make and rlhf ui
    ui.wait(90)
    printed = log_path.read_bytes()[mark:].decode(errors="replace")
    (out / "ctrl-c.log").write_text(printed)
    print(f"ui-check: after Ctrl-C make ui printed {len(printed.splitlines())} lines (ctrl-c.log):\n{printed}")
    check("Traceback" not in printed, "no traceback after Ctrl-C with a run going")
    runs = client.search_runs([exp], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    statuses = {r.info.run_name: r.info.status for r in runs}
    check(
        bool(statuses) and set(statuses.values()) <= {"KILLED", "FINISHED"} and "KILLED" in statuses.values(),
        f"the run's MLflow runs end KILLED (the finished stages FINISHED): {statuses}",
    )
    check("stopped by Ctrl-C" in printed, "the terminal says the run was stopped by Ctrl-C")
    state = stored_state(out / "prefect-home", flow_run_id)  # make ui stopped its server: read its database
    check(state[0] == "CANCELLED", f"Prefect records the flow run Cancelled, not Crashed: {state}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/ui-check", help="folder of the screenshots and logs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for each run")
    parser.add_argument("--submits", type=int, default=10, help="form submits while a run trains")
    parser.add_argument("--no-study", action="store_true", help="leave out the two-arm study from the sweep form")
    parser.add_argument("--no-ctrl-c", action="store_true", help="leave out stopping make ui with a run going")
    args = parser.parse_args(argv)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    prefect_port, mlflow_port = free_port(), free_port()
    api, mlflow_url = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(out / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    for name in ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL"):  # `make ui-check ARGS=...`: not make ui's ARGS
        env.pop(name, None)
    make = [
        "make",
        "--no-print-directory",
        "ui",
        "CONFIG=conf/smoke.yaml",
        f"PREFECT_PORT={prefect_port}",
        f"MLFLOW_PORT={mlflow_port}",
        "ARGS=",
    ]
    log_path = out / "make-ui.log"
    log = log_path.open("wb")
    ui = subprocess.Popen(make, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    driver, check = None, Checks()
    try:
        wait_for(lambda: httpx.get(f"{api}/health", timeout=5).status_code == 200, args.timeout, "the Prefect server")
        driver = browser()
        ui_url = f"http://127.0.0.1:{prefect_port}"
        form = check_forms(driver, api, ui_url, out, check)

        # the run the form's Run button makes: the shipped smoke config and two overrides
        # a KL coefficient of this check's own, so that its PPO stages train (not taken from an earlier check's cache)
        # while the form is submitted; the smaller stages come from the cache
        kl = 0.1 + (int(time.time()) % 997) / 1e6
        run = {"config_file": "conf/smoke.yaml", "ppo_total_episodes": 64, "overrides": [f"ppo.kl_coef={kl:.6f}"]}
        flow_run_id = start_run(api, form["id"], run)
        # the form's Submit while that run trains: every one accepted (they failed with 503 while runs wrote)
        # ... and a second one: the submits while two runs train
        second = start_run(api, form["id"], {**run, "overrides": [f"ppo.kl_coef={kl + 0.1:.6f}"]})
        wait_for(lambda: training(api, flow_run_id), args.timeout, "a training step of the form's run")
        wait_for(lambda: training(api, second), args.timeout, "a training step of the second run")
        codes, _ = submit_repeatedly(api, form["id"], run, args.submits)
        check(codes == [201] * args.submits, f"{args.submits} submits of the form while two runs train all created")
        check(wait_run(api, second, args.timeout)["type"] == "COMPLETED", "the second run completed")
        state = wait_run(api, flow_run_id, args.timeout)
        check(state["type"] == "COMPLETED", "the run from the form completed")
        shoot(driver, f"{ui_url}/runs/flow-run/{flow_run_id}", out / "02-prefect-run.png")
        shoot(driver, f"{ui_url}/runs/flow-run/{flow_run_id}", out / "03-prefect-artifacts.png", tab="Artifacts")
        check_pipeline_run(driver, api, ui_url, flow_run_id, out, check)
        check_mlflow(driver, mlflow_url, flow_run_id, out, check)
        check_mlflow_navigation(driver, mlflow_url, out, check)
        if not args.no_study:
            sweep_form = deployment(api, "rlhf-sweep-run/run-sweep")
            base = {"config_file": "conf/smoke.yaml", "overrides": []}
            sweep_id = start_run(api, sweep_form["id"], {"base": base, **STUDY_RUN})
            check(
                wait_run(api, sweep_id, args.timeout)["type"] == "COMPLETED", "the study from the sweep form completed"
            )
            check_study(driver, api, ui_url, mlflow_url, sweep_id, out, check)
        if not args.no_ctrl_c:
            driver.quit()
            driver = None
            check_ctrl_c(ui, api, form["id"], log_path, out, check)
        if check.failed:
            print(f"ui-check: {len(check.failed)} check(s) failed: {check.failed}", flush=True)
        return 1 if check.failed else 0
    finally:
        if driver is not None:
            driver.quit()
        if ui.poll() is None:
            os.killpg(ui.pid, signal.SIGINT)  # as Ctrl-C: make ui stops the serve process, then the servers
            try:
                ui.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(ui.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
