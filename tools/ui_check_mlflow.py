"""The MLflow side of tools/ui_check.py: the pipeline's runs in the project's saved view, and the ways into MLflow
the project does not write (its root, Recent Experiments, the native Compare)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ui_browser import REPO, Checks, page_text, shoot

VIEW = "workflowType=machine_learning"
NOTE = "NOTE: a plumbing check, not learning"


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
