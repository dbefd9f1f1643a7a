"""The pipeline's short run form: a config file chosen from ``conf/`` and a few ``key=value`` overrides.

The deployment ``rlhf-run/<config name>`` (served by ``make ui``, declared in ``prefect.yaml``) takes one parameter,
``run`` (a ``PipelineRun``): a drop-down of the shipped YAML configs (or a path to another one) and a list of
overrides such as ``ppo.kl_coef=0.1``. The parameters model loads and validates the resulting config in a pydantic
model validator, so cross-field rules (``ppo.num_mini_batches`` must divide ``ppo.batch_size``, lengths within the
model's positions, ...) are checked whenever the parameters are validated: by the flow run before any task starts
(it ends ``Failed`` with the one-sentence reason), and by ``PipelineRun.model_validate`` anywhere else. The Prefect
server itself checks the JSON schema: an unknown config file or an override without ``=`` is refused when the run is
created. The whole typed config stays available as the ``rlhf-pipeline/<config name>`` deployment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from prefect import flow
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from flows.pipeline import rlhf_pipeline
from rlhf.config import PipelineConfig, load_config
from rlhf.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"


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


class PipelineRun(BaseModel):
    """A pipeline run: a config file and a few overrides. Validating it builds and checks the whole config."""

    model_config = ConfigDict(extra="forbid", title="Pipeline run")

    config_file: ConfigFile = Field(  # type: ignore[valid-type]
        "conf/default.yaml",
        description="A config shipped in conf/: default.yaml is the built-in offline task (about 100 s on a CPU), "
        "smoke.yaml a tiny one (seconds), examples/ real models and data sets (need hub downloads).",
    )
    config_path: str = Field(
        "",
        description="Another YAML config instead of config_file: a path, relative to the checkout the runs execute "
        "in, or absolute. Leave empty to use config_file.",
    )
    overrides: list[Override] = Field(
        default_factory=list,
        description="key=value changes to the config, one per entry, with the dotted keys of the README's config "
        "reference, e.g. ppo.kl_coef=0.1 or ppo.total_episodes=3200 (values are read as YAML).",
        examples=[["ppo.kl_coef=0.1", "seed=3"]],
    )

    @model_validator(mode="after")
    def _config_is_valid(self) -> PipelineRun:
        """The config file with the overrides must be a valid config, cross-field rules included."""
        self.config()
        return self

    def source(self) -> Path:
        path = Path(self.config_path or self.config_file)
        return path if path.is_absolute() or self.config_path else REPO / path

    def config(self) -> PipelineConfig:
        """The validated config; a problem is a ValueError with one sentence naming the key."""
        try:
            return load_config(self.source(), list(self.overrides))
        except ConfigError as err:
            raise ValueError(str(err).replace(f"{REPO}/", "")) from None


def form_parameters(config_path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Default parameters of the form deployment: `config_path` (a shipped config, else given as a path)."""
    path = Path(config_path)
    relative = (path if path.is_absolute() else (Path.cwd() / path)).resolve()
    shipped = relative.relative_to(REPO).as_posix() if relative.is_relative_to(REPO) else None
    if shipped in shipped_configs():
        run = PipelineRun(config_file=shipped, overrides=overrides or [])
    else:
        run = PipelineRun(config_path=str(config_path), overrides=overrides or [])
    return {"run": run.model_dump(mode="json")}


@flow(name="rlhf-run", log_prints=True)
def rlhf_run(run: PipelineRun = PipelineRun()) -> dict[str, Any]:  # noqa: B008 (Prefect form default)
    """The RLHF pipeline from a config in conf/ and a few key=value overrides (the stages run in this flow run)."""
    return rlhf_pipeline.fn(run.config())
