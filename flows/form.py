"""The short run forms: the pipeline's and the sweep's, a config file chosen from ``conf/`` and ``key=value`` overrides.

The deployment ``rlhf-run/run-pipeline`` (served by ``make ui``, declared in ``prefect.yaml``) takes one parameter,
``run`` (a ``PipelineRun``): a drop-down of the shipped YAML configs (or a path to another one), three typed fields
(``ppo.total_episodes``, ``ppo.batch_size``, ``ppo.num_mini_batches``; empty: the config file's value) and a list of
overrides such as ``ppo.kl_coef=0.1``. The PPO batch rules (num_mini_batches x gradient_accumulation_steps divides
batch_size, total_episodes >= batch_size) are also written into the form's JSON schema, with each shipped config's
values (rlhf/config/schema_rules.py): Prefect's server refuses a bad combination when the run is created (HTTP 409),
and the UI shows the error on the field when the form is validated. The parameters model loads and validates the
resulting config in a pydantic model validator, so every other cross-field rule is checked whenever the parameters
are validated: by the flow run before any task starts (it ends ``Failed`` with the one-sentence reason), and by
``PipelineRun.model_validate`` anywhere else. The whole typed config stays available as the
``rlhf-pipeline/run-pipeline-every-setting`` deployment.

The sweep's form, ``rlhf-sweep-run/run-sweep`` (a ``SweepRun``), takes its base the same way (``base``, a
``PipelineRun``), a drop-down of the spaces shipped in ``conf/sweeps/`` (or a path to another one) and overrides of
the space (``trials=4``, ``parameters.ppo.kl_coef=[0.02, 0.2]``); every variant's config is validated with the form.
The sweep with the whole typed base config and space is ``rlhf-sweep/run-sweep-every-setting`` (flows/sweep.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from prefect import flow
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from flows.pipeline import rlhf_pipeline
from flows.sweep import rlhf_sweep
from flows.sweep_command import check_variants
from rlhf.config import PipelineConfig, apply_overrides, load_config
from rlhf.config.base import read_yaml
from rlhf.config.estimators import CRITIC_FREE_ESTIMATORS, ESTIMATOR_NAMES, GROUP_ESTIMATORS
from rlhf.config.pipeline import parse_override
from rlhf.config.schema_rules import (
    FIELD_OVERRIDE,
    FIELD_OVERRIDE_EXPECTED,
    FORM_KEYS,
    IN_THEIR_FIELDS,
    MAX_GROUP,
    MAX_MINI_BATCHES,
    field_name,
    group_clauses,
    overrides_set_a_field,
    ppo_batch_clauses,
)
from rlhf.errors import ConfigError
from rlhf.sweeps.space import SweepSpace, expand, load_space, parse_space

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
SWEEPS = CONF / "sweeps"


def shipped_configs() -> tuple[str, ...]:
    """The pipeline configs shipped in conf/ (not the sweep spaces or the examples' model configs), as paths
    relative to the checkout: ``conf/default.yaml``, ``conf/examples/hh-rlhf.yaml``, ..."""
    found = []
    for path in sorted(CONF.rglob("*.yaml")):
        if not {"sweeps", "model_configs"} & set(path.relative_to(CONF).parts):
            found.append(path.relative_to(REPO).as_posix())
    return tuple(found)


ConfigFile = Literal[shipped_configs()]  # type: ignore[valid-type]  # a drop-down in the run form
OVERRIDE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=.*$"
Override = Annotated[str, StringConstraints(pattern=OVERRIDE_PATTERN, strip_whitespace=True)]
DEFAULT_CONFIG = "conf/default.yaml"


def _schema_rules(schema: dict[str, Any]) -> None:
    """The PPO batch rules as schema clauses (rlhf/config/schema_rules.py): Prefect's server and UI check them."""
    configs = {name: load_config(REPO / name).ppo for name in shipped_configs()}
    schema["allOf"] = ppo_batch_clauses(configs, DEFAULT_CONFIG) + group_clauses(configs, DEFAULT_CONFIG)
    overrides = schema["properties"]["overrides"]["items"]
    # a string only: an empty entry (null) says only that it is not text, not that it sets a field
    overrides |= {"if": {"type": "string", "pattern": FIELD_OVERRIDE}, "then": {"const": FIELD_OVERRIDE_EXPECTED}}


def _typed(key: str, what: str, **bounds: int) -> Any:
    return Field(
        None,
        title=f"ppo.{key}",
        description=f"{what} Empty: the config file's value. Its rules with the other batch fields are checked "
        "when the form is validated.",
        **bounds,
    )


class PipelineRun(BaseModel):
    """A pipeline run: a config file and a few overrides. Validating it builds and checks the whole config."""

    model_config = ConfigDict(extra="forbid", title="Pipeline run", json_schema_extra=_schema_rules)

    config_file: ConfigFile = Field(  # type: ignore[valid-type]
        DEFAULT_CONFIG,
        description="A config shipped in conf/: default.yaml is the built-in offline task (minutes on a CPU), "
        "smoke.yaml a tiny one (seconds), examples/ real models and data sets (need hub downloads).",
    )
    config_path: str = Field(
        "",
        description="Another YAML config instead of config_file: a path, relative to the checkout the runs execute "
        "in, or absolute. Leave empty to use config_file.",
    )
    ppo_total_episodes: int | None = _typed("total_episodes", "Episodes over the whole run (>= ppo.batch_size).", ge=1)
    ppo_batch_size: int | None = _typed("batch_size", "Episodes per PPO update.", ge=1)
    ppo_num_mini_batches: int | None = _typed(
        "num_mini_batches",
        f"Minibatches per PPO epoch (at most {MAX_MINI_BATCHES} here); with ppo.gradient_accumulation_steps it must "
        "divide ppo.batch_size.",
        ge=1,
        le=MAX_MINI_BATCHES,
    )
    ppo_advantage_estimator: Literal[ESTIMATOR_NAMES] | None = Field(  # type: ignore[valid-type]
        None,
        title="ppo.advantage_estimator",
        description=f"gae (PPO with a value model), or a critic-free estimator: {', '.join(CRITIC_FREE_ESTIMATORS)} "
        "(docs/choosing-an-algorithm.md). Empty: the config file's value (gae in the shipped ones).",
    )
    ppo_samples_per_prompt: int | None = _typed(
        "samples_per_prompt",
        f"Responses sampled per prompt (a group; at most {MAX_GROUP} here): it must divide ppo.batch_size, and "
        f"{', '.join(GROUP_ESTIMATORS)} need 2 or more.",
        ge=1,
        le=MAX_GROUP,
    )
    overrides: list[Override] = Field(
        default_factory=list,
        description="key=value changes to the config, one per entry, with the dotted keys of the README's config "
        "reference, e.g. ppo.kl_coef=0.1 or seed=3 (values are read as YAML). ppo.total_episodes, ppo.batch_size "
        "ppo.num_mini_batches, ppo.advantage_estimator and ppo.samples_per_prompt have their own fields above.",
        examples=[["ppo.kl_coef=0.1", "seed=3"]],
    )

    @model_validator(mode="after")
    def _config_is_valid(self) -> PipelineRun:
        """The config file with the overrides must be a valid config, cross-field rules included."""
        if found := overrides_set_a_field(list(self.overrides)):
            raise ValueError(f"override '{found}': {IN_THEIR_FIELDS}")
        self.config()
        return self

    def field_overrides(self) -> list[str]:
        """The typed fields that are set, as overrides (applied after the free-text ones)."""
        values = {key: getattr(self, field_name(key)) for key in FORM_KEYS}
        return [f"ppo.{key}={value}" for key, value in values.items() if value is not None]

    def source(self) -> Path:
        path = Path(self.config_path or self.config_file)
        return path if path.is_absolute() or self.config_path else REPO / path

    def config(self) -> PipelineConfig:
        """The validated config; a problem is a ValueError with one sentence naming the key."""
        try:
            return load_config(self.source(), [*self.overrides, *self.field_overrides()])
        except ConfigError as err:
            raise ValueError(str(err).replace(f"{REPO}/", "")) from None


def _shipped(path: str | Path, shipped: tuple[str, ...]) -> str | None:
    """`path` as the drop-down names it (``conf/smoke.yaml``) when it is one of `shipped`, else None."""
    path = Path(path)
    relative = (path if path.is_absolute() else (Path.cwd() / path)).resolve()
    name = relative.relative_to(REPO).as_posix() if relative.is_relative_to(REPO) else None
    return name if name in shipped else None


def pipeline_run(config_path: str | Path, overrides: list[str] | None = None) -> PipelineRun:
    """The run form's values for `config_path` (picked in the drop-down when it is shipped, else given as a path)."""
    if shipped := _shipped(config_path, shipped_configs()):
        return PipelineRun(config_file=shipped, overrides=overrides or [])
    return PipelineRun(config_path=str(config_path), overrides=overrides or [])


def form_parameters(config_path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Default parameters of the form deployment: `config_path` (a shipped config, else given as a path)."""
    return {"run": pipeline_run(config_path, overrides).model_dump(mode="json")}


@flow(name="rlhf-run", log_prints=True)
def rlhf_run(run: PipelineRun = PipelineRun()) -> dict[str, Any]:  # noqa: B008 (Prefect form default)
    """The RLHF pipeline from a config in conf/ and a few key=value overrides (the stages run in this flow run)."""
    return rlhf_pipeline.fn(run.config())


# -- The sweep's short form ---------------------------------------------------------------------------------------


def shipped_spaces() -> tuple[str, ...]:
    """The sweep spaces shipped in conf/sweeps/, as paths relative to the checkout: ``conf/sweeps/kl_coef.yaml``..."""
    return tuple(path.relative_to(REPO).as_posix() for path in sorted(SWEEPS.glob("*.yaml")))


SpaceFile = Literal[shipped_spaces()]  # type: ignore[valid-type]  # a drop-down in the sweep form
DEFAULT_SPACE = "conf/sweeps/kl_coef.yaml"


def space_size(space: SweepSpace) -> str:
    """How many pipeline runs a space starts: '9 arms x 3 points = 27 runs', '8 random draws', '12 Optuna trials'."""
    if space.method == "optuna":
        return f"{space.trials} Optuna trials"
    runs = len(expand(space))
    if space.method == "random":
        return f"{runs} random draws"
    if space.arms:
        return f"{len(space.arms)} arms x {runs // len(space.arms)} points = {runs} runs"
    return f"{runs} runs"


def space_choices() -> str:
    """The shipped spaces with the number of runs each starts (the sweep form's description of its picker)."""
    sizes = []
    for path in shipped_spaces():
        try:
            sizes.append(f"{Path(path).name} ({space_size(load_space(REPO / path))})")
        except Exception:  # noqa: BLE001 (a broken space is refused when picked, with its sentence)
            sizes.append(Path(path).name)
    return "; ".join(sizes)


def space_with_overrides(path: str | Path, overrides: list[str]) -> SweepSpace:
    """A sweep space file with ``key=value`` overrides: a setting (``trials=4``, ``max_concurrency=2``,
    ``method=random``, ``optuna.pruner=none``) or a parameter's values or range (``parameters.ppo.kl_coef=[0.02, 0.2]``,
    ``parameters.ppo.lr={low: 1.0e-5, high: 1.0e-4, log: true}``), which adds the parameter when the space has none.
    Problems are one ConfigError sentence."""
    raw = read_yaml(path, "sweep space file")
    for text in overrides:
        parts, value = parse_override(text)
        if parts[0] != "parameters" or len(parts) == 1 or not isinstance(raw, dict):
            raw = apply_overrides(raw, [text]) if isinstance(raw, dict) else raw
            continue
        key, rows = ".".join(parts[1:]), raw.get("parameters") or {}
        if isinstance(rows, dict):
            raw["parameters"] = {**rows, key: value}
        else:  # a list of rows {key, values} or {key, low, high}
            row = {"key": key, **value} if isinstance(value, dict) else {"key": key, "values": value}
            raw["parameters"] = [r for r in rows if not (isinstance(r, dict) and r.get("key") == key)] + [row]
    return parse_space(raw, str(path))


class SweepRun(BaseModel):
    """A sweep: its base config as the run form takes it, a search space and a few overrides of the space.
    Validating it builds the base config, the space and every variant's config (Optuna: every choice's)."""

    model_config = ConfigDict(extra="forbid", title="Sweep run")

    base: PipelineRun = Field(
        default_factory=PipelineRun,
        description="The config every variant starts from: a config shipped in conf/ (or a path), the PPO batch "
        "sizes and key=value overrides, as in the rlhf-run form.",
    )
    space_file: SpaceFile = Field(  # type: ignore[valid-type]
        DEFAULT_SPACE,
        description="A search space shipped in conf/sweeps/, with the pipeline runs it starts: "
        f"{space_choices()} (docs/orchestration.md; algorithms*.yaml are the studies of "
        "docs/choosing-an-algorithm.md).",
    )
    space_path: str = Field(
        "",
        description="Another sweep space YAML instead of space_file: a path, relative to the checkout the runs "
        "execute in, or absolute. Leave empty to use space_file.",
    )
    space_overrides: list[Override] = Field(
        default_factory=list,
        description="key=value changes to the space, one per entry: trials=4, max_concurrency=2, method=random, "
        "optuna.pruner=none, or a parameter's values (parameters.ppo.kl_coef=[0.02, 0.2]) or range "
        "(parameters.ppo.lr={low: 1.0e-5, high: 1.0e-4, log: true}).",
        examples=[["max_concurrency=2", "parameters.ppo.kl_coef=[0.02, 0.2]"]],
    )

    @model_validator(mode="after")
    def _sweep_is_valid(self) -> SweepRun:
        """Every variant (grid, random) or choice (Optuna) of the space on the base must be a valid config."""
        try:
            check_variants(self.base.config(), self.space())
        except ConfigError as err:
            raise ValueError(str(err).replace(f"{REPO}/", "")) from None
        return self

    def space_source(self) -> Path:
        path = Path(self.space_path or self.space_file)
        return path if path.is_absolute() or self.space_path else REPO / path

    def space(self) -> SweepSpace:
        """The validated search space; a problem is a ValueError with one sentence naming the key."""
        try:
            return space_with_overrides(self.space_source(), list(self.space_overrides))
        except ConfigError as err:
            raise ValueError(str(err).replace(f"{REPO}/", "")) from None


def sweep_form_parameters(config_path: str | Path, space_path: str | Path) -> dict[str, Any]:
    """Default parameters of the sweep form deployment: the base `config_path` and the space `space_path` (each
    picked in its drop-down when it is shipped, else given as a path)."""
    base = pipeline_run(config_path)
    if shipped := _shipped(space_path, shipped_spaces()):
        run = SweepRun(base=base, space_file=shipped)
    else:
        run = SweepRun(base=base, space_path=str(space_path))
    return {"run": run.model_dump(mode="json")}


@flow(name="rlhf-sweep-run", log_prints=True, task_runner=rlhf_sweep.task_runner.duplicate())
def rlhf_sweep_run(run: SweepRun = SweepRun()) -> dict[str, Any]:  # noqa: B008 (Prefect form default)
    """A sweep from a config in conf/, a search space in conf/sweeps/ and a few key=value overrides of each (the
    variants run as subflows of this flow run)."""
    return rlhf_sweep.fn(run.base.config(), run.space())
