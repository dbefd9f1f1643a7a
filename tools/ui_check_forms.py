"""The Prefect forms' side of tools/ui_check.py: the run form refuses a broken rule of conf/smoke.yaml on its field
(in the browser, and through the validation endpoint the form calls), the sweep form lists its spaces' sizes, and the
deployments have four distinct names."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from prefect_rest import deployment
from ui_browser import REPO, Checks, page_text, shoot

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
EMPTY_OVERRIDE = {"run": {"config_file": "conf/smoke.yaml", "overrides": ["seed=1", None]}}
DEPLOYMENTS = ("run-pipeline", "run-pipeline-every-setting", "run-sweep", "run-sweep-every-setting")
SPACE_SIZES = ("kl_coef.yaml (3 runs)", "algorithms.yaml (9 arms x 3 points = 27 runs)")


def refused_in_form(driver, api: str, deployment_id: str, field_label: str, path: Path) -> bool:
    """Type 3 into the field `field_label` of the open run form (conf/smoke.yaml: batch_size 16) and press Submit:
    the server's schema validation must show what the field expects on it, and no flow run may be created."""
    from selenium.webdriver.common.by import By

    def count() -> int:
        filter_ = {"deployments": {"id": {"any_": [deployment_id]}}}
        return httpx.post(f"{api}/flow_runs/count", json=filter_, timeout=60).json()

    before = count()
    label = f"//*[starts-with(normalize-space(.), '{field_label}')]"
    driver.find_element(By.XPATH, f"{label}/following::button[normalize-space(.)='int'][1]").click()
    time.sleep(1.0)
    field = driver.find_element(By.XPATH, f"{label}/following::input[@type='number'][1]")
    field.send_keys("3")
    driver.find_element(By.XPATH, "//button[normalize-space(.)='Submit']").click()
    deadline = time.monotonic() + 180  # the first Submit after the server started waits for its one schema check
    while REFUSED[field_label] not in page_text(driver) and time.monotonic() < deadline:
        time.sleep(2.0)
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
    # the form's int box left empty sends no value: the same words, on the estimator's field (not "... is a required
    # property"); an empty override entry is not said to set a field
    left_out = {k: v for k, v in GRPO_RUN.items() if k != "ppo_samples_per_prompt"}
    for values, what in (({"run": left_out}, "ppo.samples_per_prompt left out"), (EMPTY_OVERRIDE, "an empty override")):
        said = json.dumps(
            httpx.post(
                f"{api}/ui/schemas/validate",
                json={"schema": form["parameter_openapi_schema"], "values": values},
                timeout=60,
            ).json()
        )
        wrong = ("required property", "an override of another key")
        right = GRPO_EXPECTED if values is not EMPTY_OVERRIDE else "not of type"
        check(right in said and not any(w in said for w in wrong), f"{what}: the form says {right!r}: {said[:300]}")
    refused = httpx.post(
        f"{api}/deployments/{form['id']}/create_flow_run", json={"parameters": {"run": GRPO_RUN}}, timeout=60
    )
    check(refused.status_code == 409 and "2 or more" in refused.text, f"the API refuses it: {refused.text[:200]}")

    sweep_form = deployment(api, "rlhf-sweep-run/run-sweep")
    shoot(driver, f"{ui_url}/deployments/deployment/{sweep_form['id']}/run", out / "01c-prefect-sweep-form.png")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    print(f"ui-check: the sweep form's page is {height} pixels high", flush=True)
    text = page_text(driver)
    check(all(size in text for size in SPACE_SIZES), f"the sweep form lists the space sizes {SPACE_SIZES}")
    deployment(api, f"rlhf-sweep/{DEPLOYMENTS[-1]}")
    names = [d["name"] for d in httpx.post(f"{api}/deployments/filter", json={}, timeout=60).json()]
    check(sorted(names) == sorted(DEPLOYMENTS), f"four distinct deployment names: {names}")
    shoot(driver, f"{ui_url}/deployments", out / "01e-prefect-deployments.png")
    return form
