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

While that run trains it submits the form 10 times (`--submits`) through the API call the form makes, each once: all
must be created (they failed with 503 while runs wrote; flows/prefect_server.py), with their median and 95th
percentile times printed. It also asserts what the user reads, through the UI's own API (the form's validation, the
flow run's logs and artifacts, the MLflow runs): the plumbing check's NOTE in the log, the evaluation table and the
MLflow run's description; the compare links' ``workflowType=machine_learning``; the form's error text (the grpo rule
through the validation endpoint the form calls); distinct deployment names; the sweep form's space sizes. Last, it
starts a long run, stops `make ui` with SIGINT (Ctrl-C) while the run trains, and checks that what the run's process
prints after the signal has no traceback and that its MLflow runs end KILLED (``ctrl-c.log``: what was printed).

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

REPO = Path(__file__).resolve().parent.parent
CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1920,1200",
]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    for binary in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if Path(binary).exists():
            options.binary_location = binary
    driver_path = next(
        (p for p in ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver") if Path(p).exists()), None
    )
    service = Service(executable_path=driver_path) if driver_path else Service()
    return webdriver.Chrome(options=options, service=service)


def shoot(driver, url: str, path: Path, settle: float = 6.0, search: str | None = None, tab: str | None = None) -> None:
    """A screenshot of `url`; with `search`, typed into the page's first search box first (MLflow's chart filter);
    with `tab`, the tab of that name clicked and scrolled to first."""
    from selenium.webdriver.common.by import By

    driver.get(url)
    time.sleep(settle)  # both UIs render client-side: let them fetch and draw
    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):  # MLflow's assistant panel
        try:
            if button.is_displayed():
                button.click()
                time.sleep(1.0)
        except Exception:  # noqa: BLE001 (a panel that is not there, or moved: the screenshot is taken anyway)
            pass
    if tab:  # Prefect's tabs are <li class="p-tab">
        xpath = f"//*[(self::button or self::a or @role='tab' or self::li) and normalize-space(.)='{tab}']"
        found = [element for element in driver.find_elements(By.XPATH, xpath) if element.is_displayed()]
        if found:
            driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", found[0])
            found[0].click()
            time.sleep(3.0)
    if search:
        boxes = driver.find_elements(By.CSS_SELECTOR, "input[placeholder*='Search']")
        if boxes:
            boxes[0].send_keys(search)
            time.sleep(2.0)
    driver.save_screenshot(str(path))
    print(f"ui-check: {path.relative_to(REPO)}  <- {url}", flush=True)


# What the form shows under a field for a broken rule of conf/smoke.yaml (batch_size 16), and through the
# validation endpoint the form calls for the grpo rule (the config's one sample a prompt, the field left empty)
SMOKE_DIVISORS = "a divisor of ppo.batch_size (16 in conf/smoke.yaml): 1, 2, 4, 8 or 16"
REFUSED = {
    "ppo.num_mini_batches": f"'{SMOKE_DIVISORS}' was expected",
    "ppo.samples_per_prompt": f"'{SMOKE_DIVISORS}; a batch holds whole groups of samples of a prompt' was expected",
}
GRPO_RUN = {"config_file": "conf/smoke.yaml", "ppo_advantage_estimator": "grpo", "ppo_samples_per_prompt": None}
GRPO_EXPECTED = (
    "'2 or more: ppo.advantage_estimator grpo compares the samples of a prompt (conf/smoke.yaml has 1)' was expected"
)
DEPLOYMENTS = ("run-pipeline", "run-pipeline-every-setting", "run-sweep", "run-sweep-every-setting")
SPACE_SIZES = ("kl_coef.yaml (3 runs)", "algorithms.yaml (9 arms x 3 points = 27 runs)")
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


class Checks:
    """What the user should see, each a line of the report; any failure makes the exit code 1."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> bool:
        print(f"ui-check: {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            self.failed.append(what)
        return ok


def page_text(driver) -> str:
    return driver.execute_script("return document.body.innerText")


def refused_in_form(driver, api: str, deployment_id: str, field_label: str, path: Path) -> bool:
    """Type 3 into the field `field_label` of the open run form (conf/smoke.yaml: batch_size 16) and press Submit:
    the server's schema validation must show what the field expects on it, and no flow run may be created."""
    from selenium.webdriver.common.by import By

    def count() -> int:
        filter_ = {"deployments": {"id": {"any_": [deployment_id]}}}
        return httpx.post(f"{api}/flow_runs/count", json=filter_, timeout=10).json()

    before = count()
    label = f"//*[starts-with(normalize-space(.), '{field_label}')]"
    driver.find_element(By.XPATH, f"{label}/following::button[normalize-space(.)='int'][1]").click()
    time.sleep(1.0)
    field = driver.find_element(By.XPATH, f"{label}/following::input[@type='number'][1]")
    field.send_keys("3")
    driver.find_element(By.XPATH, "//button[normalize-space(.)='Submit']").click()
    time.sleep(4.0)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", field)
    time.sleep(1.0)
    driver.save_screenshot(str(path))
    shown, after = REFUSED[field_label] in page_text(driver), count()
    print(f"ui-check: {path.relative_to(REPO)}  <- {field_label} 3: the error shown: {shown}; runs {before} -> {after}")
    return shown and after == before


def check_forms(driver, api: str, ui_url: str, out: Path, check: Checks) -> dict:
    """The run form (two refused rules in the browser, the grpo rule through the form's validation endpoint), the
    sweep form's space sizes and the deployments' names. Returns the run form's deployment."""
    form = deployment(api, "rlhf-run/run-pipeline")
    form_url = f"{ui_url}/deployments/deployment/{form['id']}/run"
    shoot(driver, form_url, out / "01-prefect-form.png")
    check(
        refused_in_form(driver, api, form["id"], "ppo.num_mini_batches", out / "01b-prefect-form-refused.png"),
        f"the form shows {REFUSED['ppo.num_mini_batches']} under ppo.num_mini_batches 3, and no run",
    )
    driver.get(form_url)
    time.sleep(6.0)
    path = out / "01d-prefect-form-group-refused.png"
    check(
        refused_in_form(driver, api, form["id"], "ppo.samples_per_prompt", path),
        f"the form shows {REFUSED['ppo.samples_per_prompt']} under ppo.samples_per_prompt 3, and no run",
    )
    validated = httpx.post(
        f"{api}/ui/schemas/validate",
        json={"schema": form["parameter_openapi_schema"], "values": {"run": GRPO_RUN}},
        timeout=60,
    ).json()
    check(GRPO_EXPECTED in json.dumps(validated), f"grpo with ppo.samples_per_prompt empty: {GRPO_EXPECTED}")
    refused = httpx.post(
        f"{api}/deployments/{form['id']}/create_flow_run", json={"parameters": {"run": GRPO_RUN}}, timeout=60
    )
    check(refused.status_code == 409 and "2 or more" in refused.text, f"the API refuses it: {refused.text[:200]}")

    sweep_form = deployment(api, "rlhf-sweep-run/run-sweep", 60)
    shoot(driver, f"{ui_url}/deployments/deployment/{sweep_form['id']}/run", out / "01c-prefect-sweep-form.png")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    print(f"ui-check: the sweep form's page is {height} pixels high", flush=True)
    text = page_text(driver)
    check(all(size in text for size in SPACE_SIZES), f"the sweep form lists the space sizes {SPACE_SIZES}")
    deployment(api, f"rlhf-sweep/{DEPLOYMENTS[-1]}", 60)
    names = [d["name"] for d in httpx.post(f"{api}/deployments/filter", json={}, timeout=10).json()]
    check(sorted(names) == sorted(DEPLOYMENTS), f"four distinct deployment names: {names}")
    shoot(driver, f"{ui_url}/deployments", out / "01e-prefect-deployments.png")
    return form


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
            check("KL" in page_text(driver) or "eval/kl" in page_text(driver), f"{name}: a KL column")
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


def check_mlflow(driver, mlflow_url: str, flow_run_id: str, out: Path, check: Checks) -> None:
    """The pipeline's MLflow runs: the experiment in the saved view, the pipeline run (its description the NOTE),
    the PPO run's charts."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{REPO}/mlruns/mlflow.db")
    runs = client.search_runs(
        [client.get_experiment_by_name("rlhf-ppo").experiment_id],
        filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'",
    )
    parent = next(r for r in runs if "stage" not in r.data.tags)
    check(
        parent.data.tags.get("mlflow.note.content", "").startswith(NOTE), "the MLflow run's description opens with NOTE"
    )
    # the PPO run that computed this run's policy (an earlier run's, when the stage came from the cache)
    ppo_run_id = parent.data.tags.get("stage.train_policy_ppo.run_id")
    exp = parent.info.experiment_id
    saved = f"viewStateShareKey=rlhf-default&{VIEW}"  # the project's saved view (rlhf/tracking/default_view.py)
    shoot(driver, f"{mlflow_url}/#/experiments/{exp}/runs?{saved}", out / "04-mlflow-experiment.png", 8)
    url = f"{mlflow_url}/#/experiments/{exp}/runs?{saved}&compareRunsMode=CHART"
    shoot(driver, url, out / "04b-mlflow-experiment-charts.png", 8)
    shoot(driver, f"{mlflow_url}/#/experiments/{exp}/runs/{parent.info.run_id}?{VIEW}", out / "05-mlflow-run.png")
    if ppo_run_id:
        url = f"{mlflow_url}/#/experiments/{exp}/runs/{ppo_run_id}/model-metrics?{VIEW}"
        shoot(driver, url, out / "06-mlflow-ppo-run.png", 8, search="objective")


GENAI_ONLY = ("Judges", "Sessions")  # side-bar entries of MLflow's GenAI navigation, not of model training
WORKFLOW_KEY = "mlflow.workflowType_v1"  # where MLflow 3.17's UI keeps the side bar's choice (browser local storage)


def check_mlflow_navigation(driver, mlflow_url: str, out: Path, check: Checks) -> None:
    """The ways into MLflow the project does not write: its root, Recent Experiments, the native Compare. MLflow 3.17
    opens them in the view chosen last in the browser (GenAI before any choice): first as a new browser sees them,
    then after the user's one step (docs/orchestration.md), the side bar's *Model training*, where each must land in
    the model-training navigation."""
    from mlflow.tracking import MlflowClient
    from selenium.webdriver.common.by import By

    client = MlflowClient(f"sqlite:///{REPO}/mlruns/mlflow.db")
    exp = client.get_experiment_by_name("rlhf-ppo")
    check(exp.tags.get("mlflow.experimentKind") == "custom_model_development", "the experiment's kind: model training")
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'", max_results=2)
    ids, compact = [r.info.run_id for r in runs], {"separators": (",", ":")}
    # the page MLflow's own Compare button opens (no workflowType)
    compare = f"{mlflow_url}/#/compare-runs?runs={json.dumps(ids, **compact)}"
    compare += f"&experiments={json.dumps([exp.experiment_id], **compact)}"

    def home_to_experiment(name: str) -> str:
        driver.get(f"{mlflow_url}/#/")
        time.sleep(8.0)
        links = [e for e in driver.find_elements(By.XPATH, "//a[normalize-space(.)='rlhf-ppo']") if e.is_displayed()]
        if links:
            links[0].click()
            time.sleep(6.0)
        driver.save_screenshot(str(out / name))
        print(f"ui-check: {name}: MLflow home -> rlhf-ppo lands on {driver.current_url}", flush=True)
        return driver.current_url

    driver.get(f"{mlflow_url}/#/")
    driver.execute_script(f"window.localStorage.removeItem('{WORKFLOW_KEY}')")  # a browser that never chose
    home_to_experiment("09-mlflow-home-experiment-new-browser.png")
    driver.get(f"{mlflow_url}/#/")
    time.sleep(8.0)
    switch = [e for e in driver.find_elements(By.XPATH, "//*[normalize-space(.)='Model training']") if e.is_displayed()]
    if switch:
        switch[-1].click()
        time.sleep(2.0)
    chosen = driver.execute_script(f"return window.localStorage.getItem('{WORKFLOW_KEY}')")
    check(chosen == '"machine_learning"', f"the side bar's Model training is kept in the browser: {chosen}")
    url = home_to_experiment("09b-mlflow-home-experiment.png")
    shown = page_text(driver)
    check(
        "genai" not in url and not any(entry in shown for entry in GENAI_ONLY),
        f"MLflow home -> rlhf-ppo lands in model training: {url}",
    )
    shoot(driver, compare, out / "09c-mlflow-native-compare.png", 8)
    shown = page_text(driver)
    check(not any(entry in shown for entry in GENAI_ONLY), "MLflow's own Compare page stays in model training")


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
    make = [
        "make",
        "--no-print-directory",
        "ui",
        "CONFIG=conf/smoke.yaml",
        f"PREFECT_PORT={prefect_port}",
        f"MLFLOW_PORT={mlflow_port}",
    ]
    log_path = out / "make-ui.log"
    log = log_path.open("wb")
    ui = subprocess.Popen(make, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    driver, check = None, Checks()
    try:
        wait_for(lambda: httpx.get(f"{api}/health", timeout=5).status_code == 200, 180, "the Prefect server")
        driver = browser()
        ui_url = f"http://127.0.0.1:{prefect_port}"
        form = check_forms(driver, api, ui_url, out, check)

        # the run the form's Run button makes: the shipped smoke config and two overrides
        run = {"config_file": "conf/smoke.yaml", "ppo_total_episodes": 64, "overrides": ["ppo.kl_coef=0.1"]}
        flow_run_id = start_run(api, form["id"], run)
        # the form's Submit while that run trains: every one accepted (they failed with 503 while runs wrote)
        wait_for(lambda: training(api, flow_run_id), args.timeout, "a training step of the form's run")
        codes, _ = submit_repeatedly(api, form["id"], run, args.submits)
        check(codes == [201] * args.submits, f"{args.submits} submits of the form while a run trains all created")
        state = wait_run(api, flow_run_id, args.timeout)
        check(state["type"] == "COMPLETED", "the run from the form completed")
        shoot(driver, f"{ui_url}/runs/flow-run/{flow_run_id}", out / "02-prefect-run.png")
        shoot(driver, f"{ui_url}/runs/flow-run/{flow_run_id}", out / "03-prefect-artifacts.png", tab="Artifacts")
        check_pipeline_run(driver, api, ui_url, flow_run_id, out, check)
        check_mlflow(driver, mlflow_url, flow_run_id, out, check)
        check_mlflow_navigation(driver, mlflow_url, out, check)
        if not args.no_study:
            sweep_form = deployment(api, "rlhf-sweep-run/run-sweep", 60)
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
