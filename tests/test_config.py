from __future__ import annotations

import pytest

from rlhf.config import ConfigError, PipelineConfig, flatten, load_config, section_digest
from tests.conftest import REPO


def test_default_and_smoke_configs_load():
    default = load_config(REPO / "conf" / "default.yaml")
    smoke = load_config(REPO / "conf" / "smoke.yaml")
    assert default.data.source == "synthetic"
    assert smoke.ppo.num_updates == 4  # 64 episodes / 16 per batch


def test_unknown_key_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  kl_coeff: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'ppo.kl_coeff'"):
        load_config(path)


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"ppo.batch_size.*'many'"):
        load_config(None, ["ppo.batch_size=many"])


def test_negative_learning_rate_rejected():
    with pytest.raises(ConfigError, match=r"reward.lr: Input should be greater than 0"):
        load_config(None, ["reward.lr=-1e-4"])


def test_minibatches_must_divide_batch():
    with pytest.raises(ConfigError, match=r"ppo.num_mini_batches \(3\) must divide ppo.batch_size \(64\)"):
        load_config(None, ["ppo.num_mini_batches=3"])


def test_gradient_accumulation_must_divide_minibatch():
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps \(3\)"):
        load_config(None, ["ppo.gradient_accumulation_steps=3"])


def test_critic_warmup_needs_a_value_model_and_updates_after_it():
    with pytest.raises(
        ConfigError, match=r"ppo.critic_warmup \(3\) trains a value model alone, and advantage_estimator grpo has"
    ):
        load_config(None, ["ppo.critic_warmup=3", "ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4"])
    ten_updates = ["ppo.total_episodes=640", "ppo.batch_size=64"]
    with pytest.raises(ConfigError, match=r"ppo.critic_warmup \(10\) holds the policy for at least every update"):
        load_config(None, [*ten_updates, "ppo.critic_warmup=10"])
    assert load_config(None, [*ten_updates, "ppo.critic_warmup=9"]).ppo.critic_warmup == 9


def test_ppo_defaults_to_a_critic_warmup_and_an_early_stop_and_the_critic_free_estimators_to_neither():
    ppo = load_config(None, ["ppo.total_episodes=6400", "ppo.batch_size=64"]).ppo  # 100 updates
    assert (ppo.warmup_updates, ppo.early_stop_kl) == (5, 0.02)
    assert ppo.resolved()["critic_warmup_resolved"] == 5 and ppo.resolved()["target_kl_resolved"] == 0.02
    short = load_config(None, ["ppo.total_episodes=2560", "ppo.batch_size=64"]).ppo  # 40 updates: a tenth is 4
    assert short.warmup_updates == 4
    off = load_config(None, ["ppo.critic_warmup=0", "ppo.target_kl=0"]).ppo
    assert (off.warmup_updates, off.early_stop_kl, off.resolved()["target_kl_resolved"]) == (0, None, "off")
    grpo = load_config(None, ["ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4"]).ppo
    assert (grpo.warmup_updates, grpo.early_stop_kl) == (0, None)


def test_local_source_needs_a_path():
    with pytest.raises(ConfigError, match=r"data.path must name"):
        load_config(None, ["data.source=local"])


def test_runtime_dtype_replaces_bf16():
    cfg = load_config(None, ["runtime.dtype=bfloat16", "runtime.attn_implementation=null"])
    assert (cfg.runtime.dtype, cfg.runtime.attn_implementation) == ("bfloat16", None)
    assert (PipelineConfig().runtime.dtype, PipelineConfig().runtime.attn_implementation) == ("auto", "sdpa")
    with pytest.raises(ConfigError, match=r"runtime.bf16 was replaced by runtime.dtype"):
        load_config(None, ["runtime.bf16=true"])
    with pytest.raises(ConfigError, match=r"runtime.dtype"):
        load_config(None, ["runtime.dtype=fp8"])


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["ppo.kl_coef=0.1", "ppo.top_k=5", "sft.model=gpt2", "ppo.stop_tokens=[7, '.']"])
    assert cfg.ppo.kl_coef == 0.1 and cfg.ppo.top_k == 5 and cfg.sft.model == "gpt2"
    assert cfg.ppo.stop_tokens == [7, "."]


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["ppo.kl_coef"])


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_digest_changes_with_content_and_flatten_has_dotted_keys():
    a, b = PipelineConfig(), load_config(None, ["ppo.kl_coef=0.2"])
    assert section_digest(a.ppo) != section_digest(b.ppo)
    assert section_digest(a.reward) == section_digest(b.reward)
    assert flatten(b)["ppo.kl_coef"] == 0.2


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, PipelineConfig.__mro__[1]):
                walk(ann)
            else:
                assert field.description, f"{model.__name__}.{name} has no description"

    walk(PipelineConfig)


def test_cli_reports_bad_config_before_loading_anything(tmp_path, capsys):
    from flows.pipeline_command import main

    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  lr: -1\n")
    assert main(["--config", str(path)]) == 2
    assert "ppo.lr: Input should be greater than 0" in capsys.readouterr().err
    assert main(["--config", str(path), "ppo.lr=1e-4", "data.source=local", f"data.path={tmp_path}/x.jsonl"]) == 2
    assert "x.jsonl does not exist" in capsys.readouterr().err


def test_config_reference_page_is_current():
    from rlhf.config.docs import CONFIG_PAGE, current_reference, reference_markdown

    assert CONFIG_PAGE == REPO / "docs" / "config.md"
    assert current_reference(CONFIG_PAGE) == reference_markdown(), "run `make docs` to regenerate docs/config.md"


def test_config_reference_shows_what_make_run_uses():
    """The reference's defaults are the model's; where conf/default.yaml (what `make run` uses) sets another value,
    a column shows it."""
    from rlhf.config.docs import reference_markdown

    rows = {line.split(" | ")[0].strip("| `"): line.split(" | ") for line in reference_markdown().splitlines()[2:]}
    assert rows["sft.steps"][2:4] == ["`600`", "**`400`**"]
    assert rows["ppo.total_episodes"][2:4] == ["`8192`", "**`6400`**"]
    assert rows["ppo.lr"][2:4] == ["`0.0003`", "**`0.0001`**"]
    assert rows["ppo.kl_coef"][3] == ""  # the same in both: left empty
    default = load_config(REPO / "conf" / "default.yaml")
    assert default.sft.steps == 400 and default.ppo.total_episodes == 6400


def test_preflight_names_unreachable_models(tmp_path, monkeypatch):
    from rlhf.preflight import preflight

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"sft.model: 'gpt2' is not a local folder and hub downloads are off"):
        preflight(load_config(None, ["sft.model=gpt2"]))
    with pytest.raises(ConfigError, match=r"sft.model: checkpoint folder ./nowhere does not exist"):
        preflight(load_config(None, ["sft.model=./nowhere"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"has no config.json"):
        preflight(load_config(None, [f"sft.model={tmp_path}/empty"]))


def test_existing_sft_checkpoint_skips_the_bootstrap(tiny_checkpoints):
    from rlhf.checkpoints import dir_digest
    from rlhf.config import RuntimeConfig, SFTConfig
    from rlhf.preflight import preflight
    from rlhf.train.sft import load_existing

    preflight(load_config(None, [f"sft.model={tiny_checkpoints['policy']}"]))
    result = load_existing(SFTConfig(model=tiny_checkpoints["policy"]), RuntimeConfig())
    assert not result.trained and result.path == tiny_checkpoints["policy"]
    assert result.digest == dir_digest(tiny_checkpoints["policy"])


def test_preflight_refuses_a_tracking_server_that_is_down_before_anything_else(monkeypatch):
    import time

    from rlhf import preflight as preflight_module

    def no_data(*args, **kwargs):
        raise AssertionError("the data source was checked before the tracking server")

    monkeypatch.setattr(preflight_module, "check_source", no_data)
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        preflight_module.preflight(load_config(None, ["tracking.uri=http://127.0.0.1:1"]))
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert message.startswith("tracking.uri: no MLflow tracking server answers at http://127.0.0.1:1")
    assert "\n" not in message


def test_tracking_probe_accepts_a_live_server_and_a_writable_sqlite_folder(tmp_path):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rlhf.tracking.store import check_tracking_uri

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check_tracking_uri(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    check_tracking_uri(f"sqlite:///{tmp_path}/not/yet/mlflow.db")  # a folder that can be created
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^tracking.uri: cannot write the SQLite store .*file/mlflow.db"):
        check_tracking_uri(f"sqlite:///{tmp_path}/file/mlflow.db")  # its 'folder' is a file


@pytest.mark.parametrize(
    ("override", "key", "shown"),
    [
        ("ppo.lr=inf", "ppo.lr", "inf"),
        ("ppo.lr=.inf", "ppo.lr", "inf"),
        ("sft.lr=1e999", "sft.lr", "1e999"),
        ("ppo.cliprange=nan", "ppo.cliprange", "nan"),
        ("ppo.kl_coef=.nan", "ppo.kl_coef", "nan"),
        ("reward.center_coef=-.inf", "reward.center_coef", "-inf"),
        ("ppo.generation.gpu_memory_utilization=nan", "ppo.generation.gpu_memory_utilization", "nan"),
        ("runtime.memory_budget_gb=.inf", "runtime.memory_budget_gb", "inf"),
    ],
)
def test_a_number_that_is_not_finite_is_refused_by_the_config_itself(override, key, shown):
    """The models refuse inf and nan (pydantic's allow_inf_nan=False on every section): before anything trains,
    instead of a loss that is NaN at the first step of the stage that reads the number."""
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "conf" / "smoke.yaml", [override])
    assert (
        str(err.value)
        == f"{REPO / 'conf' / 'smoke.yaml'}: {key} is {shown}, not a finite number; give it a finite value"
    )


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1", "mps", " cpu "])
def test_device_names_torch_knows_are_accepted(device):
    assert load_config(None, [f"runtime.device={device}"]).runtime.device == device.strip()


@pytest.mark.parametrize("device", ["gpu", "cuda1", "cuda:x", "tpu", "CPU"])
def test_a_device_name_torch_does_not_know_is_named(device):
    with pytest.raises(ConfigError, match=rf"runtime.device '{device}' is not a device: use 'auto', 'cpu', 'cuda'"):
        load_config(None, [f"runtime.device={device}"])


def test_preflight_refuses_a_device_that_is_not_there(monkeypatch):
    import torch

    from rlhf.preflight import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"runtime.device is .cuda. but this .*; use runtime.device=cpu \(or auto\)"):
        check_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda:1")
    with pytest.raises(
        ConfigError, match=r"runtime.device is 'cuda:2' but this machine has 2 CUDA devices \(cuda:0 to"
    ):
        check_device("cuda:2")
    check_device("cpu")


def test_preflight_refuses_an_output_folder_that_cannot_be(tmp_path):
    from rlhf.preflight import check_output_dir

    check_output_dir(str(tmp_path / "new" / "deeper"))  # created later, by the stages
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"runtime.output_dir: .*file is a file, not a folder"):
        check_output_dir(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"runtime.output_dir: .*file/out would be inside .*file, which is a file"):
        check_output_dir(str(tmp_path / "file" / "out"))
    # root passes every permission check, but no file can be made on /proc
    with pytest.raises(ConfigError, match=r"runtime.output_dir: /proc/rlhf-out cannot be written \(no file can be"):
        check_output_dir("/proc/rlhf-out")
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe file is gone


def test_invalid_yaml_is_one_line_with_its_position(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  lr: [1e-5\nseed: 0\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{path} is not valid YAML: ")
    assert "at line 3, column" in str(err.value)


def test_data_encoding_is_a_codec_python_knows():
    assert load_config(None, ["data.encoding=latin-1"]).data.encoding == "latin-1"
    with pytest.raises(ConfigError, match=r"data.encoding 'latin-42' is not a text encoding Python knows"):
        load_config(None, ["data.encoding=latin-42"])


def test_mlflow_tracking_uri_is_the_default_store_and_a_config_or_an_override_still_wins(tmp_path, monkeypatch):
    """MLflow's convention: where MLFLOW_TRACKING_URI is set, it is tracking.uri unless the config file or an
    override names one; a tracking server keeps its own artifact store, a local store gets mlruns/artifacts."""
    from rlhf.config.sections import DEFAULT_TRACKING_URI, LOCAL_ARTIFACTS, tracking_uri_origin

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    unset = load_config(REPO / "conf" / "default.yaml").tracking
    assert (unset.uri, unset.artifact_location) == (DEFAULT_TRACKING_URI, LOCAL_ARTIFACTS)
    assert tracking_uri_origin(unset.uri) == "the default"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.team:5000")
    for path in (None, REPO / "conf" / "default.yaml", REPO / "conf" / "smoke.yaml"):
        tracking = load_config(path).tracking
        assert (tracking.uri, tracking.artifact_location) == ("http://mlflow.team:5000", None), path
        assert tracking_uri_origin(tracking.uri) == "MLFLOW_TRACKING_URI"
    assert flatten(load_config(None))["tracking.uri"] == "http://mlflow.team:5000"  # the run's params
    override = load_config(None, [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]).tracking
    assert (override.uri, override.artifact_location) == (f"sqlite:///{tmp_path}/mlflow.db", LOCAL_ARTIFACTS)
    assert tracking_uri_origin(override.uri) == "tracking.uri"
    (tmp_path / "mine.yaml").write_text("tracking:\n  uri: http://other:5000\n  artifact_location: s3://bucket/x\n")
    named = load_config(tmp_path / "mine.yaml").tracking
    assert (named.uri, named.artifact_location) == ("http://other:5000", "s3://bucket/x")


def test_an_old_min_length_config_read_differently_now_gets_one_warning(caplog, monkeypatch):
    """Before ppo.min_length_mode was split out, ppo.missing_eos_mode: replace also made ppo.min_length_penalty
    replace the score; such a config (no min_length_mode) now subtracts, and says so in one line, once; a config that
    names the mode, or keeps missing_eos_mode at subtract, is read as before and says nothing."""
    import logging

    from rlhf.config import base

    monkeypatch.setattr(base, "_warned", set())  # once per process: this test sees its own
    old = ["ppo.min_response_length=4", "ppo.min_length_penalty=-1", "ppo.missing_eos_mode=replace"]
    with caplog.at_level(logging.WARNING, logger="rlhf.config"):
        assert load_config(None, [*old, "ppo.min_length_mode=replace"]).ppo.min_length_mode == "replace"
        load_config(None, old[:2])
        assert [r for r in caplog.records if r.name == "rlhf.config"] == []
        assert load_config(None, old).ppo.min_length_mode == "subtract"
        load_config(None, old)
    warned = [r.getMessage() for r in caplog.records if r.name == "rlhf.config"]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert (
        warned[0].startswith("warning: ppo.min_length_penalty now subtracts")
        and "min_length_mode: replace" in warned[0]
    )
