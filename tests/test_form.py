"""The short run form of the pipeline deployment (flows/form.py): a shipped config, overrides, cross-field rules."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flows.form import PipelineRun, form_parameters, shipped_configs
from rlhf.config import load_config
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
    assert form_parameters("conf/smoke.yaml") == {
        "run": {"config_file": "conf/smoke.yaml", "config_path": "", "overrides": []}
    }


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"overrides": ["ppo.num_mini_batches=3"]}, "ppo.num_mini_batches (3) must divide ppo.batch_size (64)"),
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
