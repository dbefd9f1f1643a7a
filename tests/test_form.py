"""The short run form of the pipeline deployment (flows/form.py): a shipped config, overrides, cross-field rules,
and those rules in the form's JSON schema, as Prefect's server checks them (rlhf/config/schema_rules.py)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from flows.form import PipelineRun, form_parameters, rlhf_run, shipped_configs
from rlhf.config import load_config
from rlhf.config.schema_rules import BREAKPOINTS
from tests.conftest import REPO


def test_the_drop_down_lists_the_shipped_pipeline_configs():
    configs = shipped_configs()
    assert {"conf/default.yaml", "conf/smoke.yaml", "conf/examples/hh-rlhf.yaml"} <= set(configs)
    assert not [c for c in configs if "sweeps" in c or "model_configs" in c]
    schema = PipelineRun.model_json_schema()["properties"]
    assert schema["config_file"]["enum"] == list(configs)
    assert schema["overrides"]["items"]["pattern"]


def test_a_config_file_and_overrides_give_the_config():
    run = PipelineRun(config_file="conf/smoke.yaml", overrides=["ppo.kl_coef=0.1", "seed=3"])
    assert run.config() == load_config(REPO / "conf" / "smoke.yaml", ["ppo.kl_coef=0.1", "seed=3"])
    assert PipelineRun().config() == load_config(REPO / "conf" / "default.yaml")
    empty = {
        "ppo_total_episodes": None,
        "ppo_batch_size": None,
        "ppo_num_mini_batches": None,
        "ppo_advantage_estimator": None,
        "ppo_samples_per_prompt": None,
    }
    assert form_parameters("conf/smoke.yaml") == {
        "run": {"config_file": "conf/smoke.yaml", "config_path": "", **empty, "overrides": []}
    }
    typed = PipelineRun(config_file="conf/smoke.yaml", ppo_batch_size=32, ppo_total_episodes=96, overrides=["seed=3"])
    assert typed.config() == load_config(
        REPO / "conf" / "smoke.yaml", ["seed=3", "ppo.batch_size=32", "ppo.total_episodes=96"]
    )


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"ppo_num_mini_batches": 3}, "ppo.num_mini_batches (3) must divide ppo.batch_size (64)"),
        (
            {"overrides": ["ppo.num_mini_batches=3"]},
            "set ppo.total_episodes, batch_size, num_mini_batches, advantage_estimator and",
        ),
        ({"overrides": ["ppo={}"]}, "set ppo.total_episodes, batch_size, num_mini_batches, advantage_estimator and"),
        ({"ppo_num_mini_batches": 129}, "less than or equal to 128"),
        ({"overrides": ["ppo.kl_cof=0.1"]}, "unknown key 'ppo.kl_cof'"),
        ({"overrides": ["seed"]}, "should match pattern"),
        ({"config_file": "conf/nope.yaml"}, "Input should be"),
        ({"config_path": "conf/nope.yaml"}, "does not exist"),
    ],
)
def test_bad_parameters_are_refused_by_validation(run, message):
    with pytest.raises(ValidationError) as err:
        PipelineRun.model_validate(run)
    assert message in str(err.value)


def _schema_errors(run: dict, schema: dict) -> dict:
    """The errors Prefect's server reports for these form values (its own validation code and error layout)."""
    from prefect.utilities.schema_tools.validation import build_error_obj, validate

    return build_error_obj(validate({"run": run}, schema, preprocess=True))


def _fields(errors: dict) -> dict:
    """The form's fields and their messages, from `_schema_errors`."""
    return {e["property"]: e["errors"] for e in errors["errors"][0]["errors"]}


@pytest.mark.parametrize(
    ("run", "field", "message"),
    [
        (  # the config's one sample a prompt, the field left empty
            {"ppo_advantage_estimator": "grpo", "ppo_samples_per_prompt": None},
            "ppo_samples_per_prompt",
            "'2 or more: ppo.advantage_estimator grpo compares the samples of a prompt (conf/smoke.yaml has 1)' was "
            "expected",
        ),
        (  # the same with the field left out (the form's int box left empty): said on the estimator's field
            {"ppo_advantage_estimator": "grpo"},
            "ppo_advantage_estimator",
            "'2 or more: ppo.advantage_estimator grpo compares the samples of a prompt (conf/smoke.yaml has 1)' was "
            "expected",
        ),
        (
            {"ppo_advantage_estimator": "rloo", "ppo_samples_per_prompt": 1},
            "ppo_samples_per_prompt",
            "'2 or more: ppo.advantage_estimator rloo compares the samples of a prompt' was expected",
        ),
        (  # the batch size it must divide is the config file's
            {"ppo_samples_per_prompt": 3},
            "ppo_samples_per_prompt",
            "'a divisor of ppo.batch_size (16 in conf/smoke.yaml): 1, 2, 4, 8 or 16; a batch holds whole groups of "
            "samples of a prompt' was expected",
        ),
        (
            {"ppo_batch_size": 24, "ppo_samples_per_prompt": 5},
            "ppo_batch_size",
            "'a multiple of ppo.samples_per_prompt (5): a batch holds whole groups of samples of a prompt' was "
            "expected",
        ),
    ],
    ids=[
        "grpo-with-the-configs-one-sample",
        "grpo-with-the-field-left-out",
        "rloo-with-one-sample",
        "the-configs-batch",
        "a-typed-batch",
    ],
)
def test_the_form_says_what_each_group_rule_expects(form_schema, run, field, message):
    """Prefect's UI shows these messages on the field (its validation code, as the server runs it)."""
    errors = _schema_errors({"config_file": "conf/smoke.yaml", **run}, form_schema)
    assert _fields(errors) == {field: [message]}


def _schema_check(schema: dict):
    """Prefect's validator for this schema, built once (as `validate` builds it on each call): run -> valid."""
    from prefect._internal.schemas._registry import non_fetching_registry
    from prefect.utilities.schema_tools.validation import _VALIDATOR, preprocess_schema

    validator = _VALIDATOR(
        preprocess_schema(schema), format_checker=_VALIDATOR.FORMAT_CHECKER, registry=non_fetching_registry()
    )
    return lambda run: validator.is_valid({"run": run})  # stops at the first error


@pytest.fixture(scope="module")
def form_schema() -> dict:
    """The deployment's parameter schema, as Prefect builds it from the flow's signature."""
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(rlhf_run).model_dump_for_openapi()


def test_the_schema_refuses_a_bad_batch_combination_on_its_field(form_schema):
    errors = _schema_errors({"config_file": "conf/smoke.yaml", "ppo_num_mini_batches": 3}, form_schema)
    assert errors == {
        "errors": [{"property": "run", "errors": [{"property": "ppo_num_mini_batches", "errors": [
            "'a divisor of ppo.batch_size (16 in conf/smoke.yaml): 1, 2, 4, 8 or 16' was expected"
        ]}]}],
        "valid": False,
    }  # fmt: skip
    errors = _schema_errors({"ppo_batch_size": 48, "ppo_num_mini_batches": 5, "ppo_total_episodes": 1}, form_schema)
    assert _fields(errors) == {  # each broken rule once, on one field
        "ppo_batch_size": ["'a multiple of ppo.num_mini_batches (5)' was expected"],
        "ppo_total_episodes": ["'at least ppo.batch_size (48)' was expected"],
    }
    errors = _schema_errors({"overrides": ["seed=1", "ppo.batch_size=8"]}, form_schema)
    (overrides,) = errors["errors"][0]["errors"]
    assert overrides == {"property": "overrides", "errors": [{"index": 1, "errors": [
        "'an override of another key (set ppo.total_episodes, batch_size, num_mini_batches, advantage_estimator and "
        "samples_per_prompt in their fields)' was expected"
    ]}]}  # fmt: skip
    # an empty entry (the form's "+" pressed, nothing typed): only that it is not text, no rule about fields
    (overrides,) = _schema_errors({"overrides": ["seed=1", None]}, form_schema)["errors"][0]["errors"]
    assert overrides == {"property": "overrides", "errors": [{"index": 1, "errors": ["None is not of type 'string'"]}]}
    assert _schema_errors({"config_file": "conf/smoke.yaml", "ppo_num_mini_batches": 4}, form_schema)["valid"]


GRID = {
    "config_file": ["conf/default.yaml", "conf/smoke.yaml", "conf/examples/tinyllama-1.1b-lora-hh.yaml", None],
    "ppo_total_episodes": [None, 32, 64, 100, 6400],
    "ppo_batch_size": [None, 16, 24, 36, 40, 64, 96],
    "ppo_num_mini_batches": [None, 1, 3, 4, 8],
    "overrides": [[], ["ppo.gradient_accumulation_steps=3"]],
}


def test_the_schema_agrees_with_the_config_validators(form_schema, tmp_path):
    """Over a grid of the typed fields, shipped configs (one with accumulation steps), a config given by path and
    an accumulation override: the schema never refuses a valid run, and refuses every invalid one it can know of."""
    other = tmp_path / "other.yaml"
    other.write_text("ppo:\n  batch_size: 32\n  num_mini_batches: 2\n  total_episodes: 64\n")
    checked = refused = 0
    schema_check = _schema_check(form_schema)
    for values in itertools.product(*GRID.values()):
        run = {k: v for k, v in zip(GRID, values, strict=True) if v is not None}
        if "config_file" not in run:
            run["config_path"] = str(other)
        try:
            PipelineRun.model_validate(run)
            valid = True
        except ValidationError:
            valid = False
        schema_valid = schema_check(run)
        assert valid or not schema_valid or not _knowable(run), run
        assert schema_valid or not valid, run  # never a valid run refused
        checked, refused = checked + 1, refused + (not schema_valid)
    assert (checked, refused) == (1400, 340)  # the grid has many bad combinations


def _knowable(run: dict) -> bool:
    """Whether the schema is meant to refuse this run when it is invalid: a shipped config (its values known),
    the accumulation steps not overridden, and total >= batch exact when both are typed."""
    if "config_path" in run or run["overrides"]:
        return False
    return "ppo_total_episodes" not in run or run.get("ppo_batch_size", 1) in BREAKPOINTS


GROUP_GRID = {
    "config_file": ["conf/default.yaml", "conf/smoke.yaml", None],
    "ppo_batch_size": [None, 16, 24, 36],
    "ppo_advantage_estimator": [None, "gae", "grpo", "reinforce_pp"],
    "ppo_samples_per_prompt": [None, 1, 3, 4, 5],
}


def test_the_schema_agrees_with_the_estimators_group_rules(form_schema):
    """Over the estimator and group-size fields with shipped configs: the schema refuses exactly the runs the
    config refuses (a group size that does not divide the batch, a group estimator with one sample a prompt)."""
    checked = refused = 0
    schema_check = _schema_check(form_schema)
    for values in itertools.product(*GROUP_GRID.values()):
        run = {k: v for k, v in zip(GROUP_GRID, values, strict=True) if v is not None}
        try:
            PipelineRun.model_validate(run)
            valid = True
        except ValidationError:
            valid = False
        assert schema_check(run) == valid, run
        checked, refused = checked + 1, refused + (not valid)
    assert checked == 240 and refused > 80


TIMEOUT_S = 60


def _post(url: str, body: dict) -> httpx.Response:
    """POST to the test harness's server, again after a 503: its SQLite store answers "Service Unavailable" while a
    write of another request holds it on a busy machine (seen once in a full run on the 2-core machine)."""
    for _ in range(3):
        response = httpx.post(url, json=body, timeout=TIMEOUT_S)
        if response.status_code != 503:
            return response
        time.sleep(2)
    return response


@pytest.mark.slow
def test_prefect_refuses_a_bad_combination_before_a_flow_run_exists(harness):
    """A real Prefect server (the test harness's): the form's deployment refuses to create a run with a bad batch
    combination (409, the field named), no flow run is created, and the UI's validation endpoint reports it. The
    server validates the form's whole schema on each call: seconds on a busy machine, past httpx's 5 s default."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    deployment_id = rlhf_run.to_deployment(name="smoke", parameters=form_parameters("conf/smoke.yaml")).apply()
    api = PREFECT_API_URL.value()
    deployment = httpx.get(f"{api}/deployments/{deployment_id}", timeout=TIMEOUT_S).json()
    assert deployment["enforce_parameter_schema"]
    bad = [
        {"config_file": "conf/smoke.yaml", "ppo_num_mini_batches": 3},
        {"config_file": "conf/smoke.yaml", "overrides": ["ppo.num_mini_batches=3"]},
        {"config_file": "conf/smoke.yaml", "ppo_batch_size": 128},  # more than its total_episodes (64)
    ]
    for run in bad:
        refused = _post(f"{api}/deployments/{deployment_id}/create_flow_run", {"parameters": {"run": run}})
        assert refused.status_code == 409, (run, refused.text)
        assert "Validation failed for field 'run." in refused.json()["detail"], refused.text
    with get_client(sync_client=True) as client:
        assert client.read_flow_runs() == []
    checked = _post(
        f"{api}/ui/schemas/validate", {"schema": deployment["parameter_openapi_schema"], "values": {"run": bad[0]}}
    )
    assert checked.status_code == 200 and checked.json() == {
        "errors": [{"property": "run", "errors": [{"property": "ppo_num_mini_batches", "errors": [
            "'a divisor of ppo.batch_size (16 in conf/smoke.yaml): 1, 2, 4, 8 or 16' was expected"
        ]}]}],
        "valid": False,
    }, checked.text  # fmt: skip
    good = {"config_file": "conf/smoke.yaml", "ppo_num_mini_batches": 4, "ppo_batch_size": 32}
    created = _post(f"{api}/deployments/{deployment_id}/create_flow_run", {"parameters": {"run": good}})
    assert created.status_code == 201, created.text


# -- The sweep's short form ---------------------------------------------------------------------------------------


def test_the_sweep_form_takes_its_base_as_the_run_form_and_a_shipped_space():
    from flows.form import SweepRun, shipped_spaces, sweep_form_parameters

    assert {"conf/sweeps/kl_coef.yaml", "conf/sweeps/ppo_optuna.yaml"} <= set(shipped_spaces())
    schema = SweepRun.model_json_schema()
    assert schema["properties"]["space_file"]["enum"] == list(shipped_spaces())
    assert schema["$defs"]["PipelineRun"]["properties"]["config_file"]["enum"] == list(shipped_configs())
    assert "PipelineConfig" not in schema["$defs"] and "SweepSpace" not in schema["$defs"]  # no typed config here
    run = SweepRun.model_validate(
        {
            "base": {"config_file": "conf/smoke.yaml", "ppo_batch_size": 32, "overrides": ["seed=3"]},
            "space_file": "conf/sweeps/kl_coef.yaml",
            "space_overrides": ["max_concurrency=2", "parameters.ppo.kl_coef=[0.02, 0.2]", "parameters.ppo.lr=[0.001]"],
        }
    )
    assert run.base.config() == load_config(REPO / "conf" / "smoke.yaml", ["seed=3", "ppo.batch_size=32"])
    space = run.space()
    assert (space.name, space.max_concurrency) == ("kl_coef", 2)
    assert space.axes == {"ppo.kl_coef": [0.02, 0.2], "ppo.lr": [0.001]}  # a parameter replaced, one added
    assert sweep_form_parameters("conf/smoke.yaml", "conf/sweeps/ppo_optuna.yaml") == {
        "run": {
            "base": form_parameters("conf/smoke.yaml")["run"],
            "space_file": "conf/sweeps/ppo_optuna.yaml",
            "space_path": "",
            "space_overrides": [],
        }
    }


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"space_file": "conf/sweeps/nope.yaml"}, "Input should be"),
        ({"space_overrides": ["parameters.ppo.kl_cof=[0.1]"]}, "parameters.ppo.kl_cof is not a config key"),
        ({"space_overrides": ["trails=4"]}, "unknown key 'trails'"),
        # a variant the config rejects: refused with the form, before anything runs
        ({"space_overrides": ["parameters.ppo.num_mini_batches=[3]"]}, "ppo.num_mini_batches (3) must divide"),
        ({"base": {"overrides": ["ppo.kl_cof=0.1"]}}, "unknown key 'ppo.kl_cof'"),
        ({"space_path": "conf/sweeps/nope.yaml"}, "does not exist"),
    ],
)
def test_a_bad_sweep_is_refused_by_the_forms_validation(run, message):
    from flows.form import SweepRun

    with pytest.raises(ValidationError) as err:
        SweepRun.model_validate(run)
    assert message in str(err.value)


def test_the_sweep_form_says_how_many_runs_each_space_starts():
    from flows.form import SweepRun, shipped_spaces

    description = SweepRun.model_json_schema()["properties"]["space_file"]["description"]
    for path in shipped_spaces():  # every shipped space, with its size
        assert Path(path).name + " (" in description, path
    assert "algorithms.yaml (9 arms x 3 points = 27 runs)" in description
    assert "ppo_optuna.yaml (12 Optuna trials)" in description and "kl_coef.yaml (3 runs)" in description
