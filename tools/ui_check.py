"""`make ui-check`: the Prefect and MLflow UIs checked in a real (headless) browser.

Starts `make ui` (conf/smoke.yaml as the forms' default, free ports, its own Prefect home and MLflow store under
outputs/ui-check/), opens the short run form of ``rlhf-run/run-pipeline`` in headless Chromium, starts a small run with
the form's parameters, waits for it, and writes screenshots to outputs/ui-check/:

    01-prefect-form.png        the deployment's run form (config drop-down, PPO batch fields, overrides)
    01b-prefect-form-refused.png  the form after Submit with ppo.num_mini_batches 3 (smoke's batch_size is 16): the
                               schema's error on the field, and no flow run created (checked through the API)
    01c-prefect-sweep-form.png the sweep's short form (``rlhf-sweep-run/run-sweep``): the base as the run form takes
                               it, a drop-down of conf/sweeps/, overrides of the space; its page height is printed
    02-prefect-run.png         the finished flow run (task graph and states)
    03-prefect-artifacts.png   its Artifacts tab (progress bars, evaluation table, MLflow link)
    04-mlflow-experiment.png   the experiment in the project's saved view (columns: win rates, KL, RM accuracy, key
                               parameters), as the links the project writes open it
    04b-mlflow-experiment-charts.png  the same view's charts: the PPO sections first
    05-mlflow-run.png          the pipeline's MLflow run (the page the Prefect link opens)
    06-mlflow-ppo-run.png      the PPO stage's MLflow run, its `objective/` charts (score, KL, gold score, ...)

Needs Debian's chromium and chromium-driver (``apt-get install -y chromium chromium-driver``) and selenium (the
make target installs it into .venv). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(1.0)
    raise SystemExit(f"ui-check: {what} did not happen within {timeout:.0f}s")


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


def refused_in_form(driver, api: str, deployment_id: str, path: Path) -> bool:
    """Type ppo.num_mini_batches = 3 into the open run form (conf/smoke.yaml: batch_size 16) and press Submit: the
    server's schema validation must show its error on the field and no flow run may be created."""
    from selenium.webdriver.common.by import By

    def count() -> int:
        filter_ = {"deployments": {"id": {"any_": [deployment_id]}}}
        return httpx.post(f"{api}/flow_runs/count", json=filter_, timeout=10).json()

    before = count()
    label = "//*[starts-with(normalize-space(.), 'ppo.num_mini_batches')]"
    driver.find_element(By.XPATH, f"{label}/following::button[normalize-space(.)='int'][1]").click()
    time.sleep(1.0)
    field = driver.find_element(By.XPATH, f"{label}/following::input[@type='number'][1]")
    field.send_keys("3")
    driver.find_element(By.XPATH, "//button[normalize-space(.)='Submit']").click()
    time.sleep(4.0)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", field)
    time.sleep(1.0)
    driver.save_screenshot(str(path))
    shown = "3 is not one of [1, 2, 4, 8, 16]" in driver.execute_script("return document.body.innerText")
    print(f"ui-check: {path.relative_to(REPO)}  <- the error shown: {shown}; flow runs {before} -> {count()}")
    return shown and count() == before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/ui-check", help="folder of the screenshots and logs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the run")
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
    log = (out / "make-ui.log").open("wb")
    ui = subprocess.Popen(make, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    driver = None
    try:
        wait_for(lambda: httpx.get(f"{api}/health", timeout=5).status_code == 200, 180, "the Prefect server")
        deployment = wait_for(
            lambda: (
                (r := httpx.get(f"{api}/deployments/name/rlhf-run/run-pipeline", timeout=10)).status_code == 200
                and r.json()
            ),
            180,
            "the rlhf-run/run-pipeline deployment",
        )
        driver = browser()
        ui_url = f"http://127.0.0.1:{prefect_port}"
        form_url = f"{ui_url}/deployments/deployment/{deployment['id']}/run"
        shoot(driver, form_url, out / "01-prefect-form.png")
        if not refused_in_form(driver, api, deployment["id"], out / "01b-prefect-form-refused.png"):
            print("ui-check: the form did not show the batch rule's error", flush=True)
            return 1
        sweep_form = wait_for(  # serve registers the deployments one after the other
            lambda: (
                (r := httpx.get(f"{api}/deployments/name/rlhf-sweep-run/run-sweep", timeout=10)).status_code == 200
                and r.json()
            ),
            60,
            "the rlhf-sweep-run/run-sweep deployment",
        )
        shoot(driver, f"{ui_url}/deployments/deployment/{sweep_form['id']}/run", out / "01c-prefect-sweep-form.png")
        height = driver.execute_script("return document.documentElement.scrollHeight")
        print(f"ui-check: the sweep form's page is {height} pixels high", flush=True)

        # the run the form's Run button makes: the shipped smoke config and two overrides
        run = {"config_file": "conf/smoke.yaml", "ppo_total_episodes": 64, "overrides": ["ppo.kl_coef=0.1"]}
        created = httpx.post(
            f"{api}/deployments/{deployment['id']}/create_flow_run", json={"parameters": {"run": run}}, timeout=30
        )
        created.raise_for_status()
        flow_run_id = created.json()["id"]
        print(f"ui-check: flow run {flow_run_id} started from the form's parameters {run}", flush=True)

        def finished():
            state = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]
            return state if state and state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

        state = wait_for(finished, args.timeout, "the flow run")
        print(f"ui-check: flow run {state['type']}", flush=True)
        shoot(driver, f"{ui_url}/runs/flow-run/{flow_run_id}", out / "02-prefect-run.png")
        shoot(driver, f"{ui_url}/runs/flow-run/{flow_run_id}", out / "03-prefect-artifacts.png", tab="Artifacts")

        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{REPO}/mlruns/mlflow.db")
        runs = client.search_runs(
            [client.get_experiment_by_name("rlhf-ppo").experiment_id],
            filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'",
        )
        parent = next(r for r in runs if "stage" not in r.data.tags)
        # the PPO run that computed this run's policy (an earlier run's, when the stage came from the cache)
        ppo_run_id = parent.data.tags.get("stage.train_policy_ppo.run_id")
        exp = parent.info.experiment_id
        view = "workflowType=machine_learning"
        saved = f"viewStateShareKey=rlhf-default&{view}"  # the project's saved view (rlhf/tracking/default_view.py)
        shoot(driver, f"{mlflow_url}/#/experiments/{exp}/runs?{saved}", out / "04-mlflow-experiment.png", 8)
        url = f"{mlflow_url}/#/experiments/{exp}/runs?{saved}&compareRunsMode=CHART"
        shoot(driver, url, out / "04b-mlflow-experiment-charts.png", 8)
        shoot(driver, f"{mlflow_url}/#/experiments/{exp}/runs/{parent.info.run_id}?{view}", out / "05-mlflow-run.png")
        if ppo_run_id:
            url = f"{mlflow_url}/#/experiments/{exp}/runs/{ppo_run_id}/model-metrics?{view}"
            shoot(driver, url, out / "06-mlflow-ppo-run.png", 8, search="objective")
        return 0 if state["type"] == "COMPLETED" else 1
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
