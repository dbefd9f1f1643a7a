"""Hyper-parameter sweeps: a search space over dotted config keys, expanded into pipeline configs.

A space is a small YAML file (see ``conf/sweeps/kl_coef.yaml``)::

    name: kl_coef
    method: grid            # grid: every combination of the listed values
    parameters:
      ppo.kl_coef: [0.01, 0.05, 0.2]

    method: random          # random: `trials` draws, reproducible from seed
    trials: 6
    seed: 0
    parameters:
      ppo.lr: {low: 1.0e-5, high: 1.0e-3, log: true}
      ppo.kl_coef: [0.02, 0.05]     # a list is a uniform choice

    method: optuna          # optuna: `trials` trials asked of an Optuna study (TPE), hopeless ones pruned
    trials: 12
    optuna: {pruner: median, n_startup_trials: 3}

Variants run `max_concurrency` at a time (default: one per GPU of the machine), in this process or, with
`deployment`, as flow runs of a Prefect deployment picked up by the workers of its work pool.

Every problem (unknown key, empty list, bad range, a value the config rejects) is one sentence naming the key,
raised before anything runs. No Prefect and no MLflow here: the sweep flow lives in ``flows/sweep.py``.
"""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlhf.config import PipelineConfig, apply_overrides, build_config, format_validation_error, read_yaml
from rlhf.errors import ConfigError

# Keys a sweep may not vary: the variants must share one MLflow store, and the sweep names the runs.
FIXED_PREFIXES = ("tracking", "run_name")
SCALARS = (bool, int, float, str)  # the values Optuna chooses among


class Range(BaseModel):
    """A continuous (or integer) interval for random search."""

    model_config = ConfigDict(extra="forbid")

    low: float = Field(description="Lower bound (inclusive).")
    high: float = Field(description="Upper bound.")
    log: bool = Field(False, description="Sample uniformly in log space (both bounds must be > 0).")
    integer: bool = Field(False, description="Round each draw to the nearest integer.")


class SearchParameter(BaseModel):
    """One axis of a search space: a config key and the values to try, or a range to draw from. In YAML a space's
    parameters are a mapping ``key: [values]`` or ``key: {low, high, log, integer}``; the Prefect form shows one
    row of these typed fields per parameter."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(description="Dotted config key, e.g. ppo.kl_coef.")
    values: list[Any] | None = Field(
        None, description="Values to try: every one (grid), or a uniform choice among them (random, optuna)."
    )
    low: float | None = Field(None, description="Lower bound of a range (random, optuna); leave values empty.")
    high: float | None = Field(None, description="Upper bound of a range.")
    log: bool = Field(False, description="Draw the range uniformly in log space (both bounds > 0).")
    integer: bool = Field(False, description="Round each draw to an integer.")

    def check_values_or_range(self) -> None:
        """Raise ValueError unless the row gives either values or both bounds of a range."""
        has_range = self.low is not None or self.high is not None
        if self.values is not None and has_range:
            raise ValueError(f"parameters.{self.key} has both values and low/high; give one of them")
        if self.values is None and (self.low is None or self.high is None):
            raise ValueError(f"parameters.{self.key} needs values, or low and high")

    def axis(self) -> list[Any] | Range:
        if self.values is not None:
            return self.values
        return Range(low=self.low, high=self.high, log=self.log, integer=self.integer)


class OptunaSettings(BaseModel):
    """How an Optuna study searches (method: optuna): its sampler, its pruner and where it is stored."""

    model_config = ConfigDict(extra="forbid")

    sampler: Literal["tpe", "random"] = Field(
        "tpe", description="'tpe': Bayesian (Tree-structured Parzen Estimator); 'random': independent draws."
    )
    pruner: Literal["median", "hyperband", "none"] = Field(
        "median",
        description="Stops hopeless trials from PPO's periodic evaluations (ppo.eval_every): 'median' prunes a "
        "trial below the median of earlier trials at the same update, 'hyperband' by successive halving, 'none'.",
    )
    n_startup_trials: int = Field(
        2, ge=0, description="Trials finished before the pruner prunes and before TPE models the space."
    )
    n_warmup_steps: int = Field(0, ge=0, description="PPO updates of a trial before it may be pruned.")
    storage: str | None = Field(
        None,
        description="SQLAlchemy URL of the study, e.g. postgresql://... for sweeps across machines; default: "
        "sqlite optuna.db next to the MLflow store (a killed sweep, started again, resumes its study).",
    )
    enqueue: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Points evaluated first, as {dotted key: value} (e.g. today's defaults); missing keys are sampled.",
    )


class Arm(BaseModel):
    """One named set of overrides of a study (e.g. an algorithm with its settings): every point of the space's
    parameters runs once per arm, so that arms are compared on the same seeds and shared stages."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The arm's name: a row of the study table, a colour of its plot (e.g. PPO).")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted config keys and their values for this arm."
    )


class SweepSpace(BaseModel):
    """A search space: dotted config keys mapped to a list of values or a range, and how to run the variants."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        description="Sweep name: names the MLflow sweep run and the variants' runs.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
    )
    method: Literal["grid", "random", "optuna"] = Field(
        "grid",
        description="'grid': every combination of the lists; 'random': `trials` reproducible draws; 'optuna': "
        "`trials` trials of an Optuna study (settings in `optuna`), hopeless trials pruned early.",
    )
    parameters: list[SearchParameter] = Field(
        default_factory=list,
        description="The parameters to vary: a config key with its values, or a range {low, high, log, integer} "
        "(random and optuna). In YAML a mapping, key: [values] or key: {low: .., high: ..}.",
    )
    arms: list[Arm] = Field(
        default_factory=list,
        description="A study's arms (grid only): named override sets, each run at every point of `parameters` "
        "(e.g. the algorithms, with policy_seed as the parameter); the sweep then also tabulates each arm's mean "
        "and 95% interval over its points, and plots gold reward against sqrt(KL) one colour per arm.",
    )
    trials: int = Field(8, ge=1, description="Number of variants drawn (random) or trials run (optuna).")
    seed: int = Field(0, description="Seed of the random draws and of Optuna's sampler.")
    max_concurrency: int | None = Field(
        None,
        ge=1,
        description="Variants that run at once. Default: the number of GPUs of this machine (1 without); with "
        "`deployment`, the number of workers of the work pool.",
    )
    deployment: str | None = Field(
        None,
        description="Run every variant as a flow run of this pipeline deployment, e.g. "
        "'rlhf-pipeline/run-pipeline-every-setting' (prefect.yaml; it takes the whole config), picked up by the "
        "workers of its work pool; default: in this process.",
    )
    optuna: OptunaSettings = Field(default_factory=OptunaSettings, description="Settings of method: optuna.")

    @model_validator(mode="before")
    @classmethod
    def _n_random_is_trials(cls, data: Any) -> Any:
        if isinstance(data, dict) and "n_random" in data:  # the name of `trials` before Optuna came
            data = {**data, "trials": data.get("trials", data["n_random"])}
            del data["n_random"]
        return data

    @model_validator(mode="before")
    @classmethod
    def _mapping_to_rows(cls, data: Any) -> Any:
        """The YAML mapping of parameters as rows of SearchParameter."""
        if isinstance(data, dict) and isinstance(data.get("parameters"), dict):
            rows = [
                {"key": key, **values} if isinstance(values, dict) else {"key": key, "values": values}
                for key, values in data["parameters"].items()
            ]
            data = {**data, "parameters": rows}
        return data

    @property
    def axes(self) -> dict[str, list[Any] | Range]:
        """The parameters as {dotted key: list of values or Range}, in their order."""
        return {p.key: p.axis() for p in self.parameters}

    @model_validator(mode="after")
    def _check(self) -> SweepSpace:
        if not self.parameters and not self.arms:
            raise ValueError(f"sweep '{self.name}' has no parameters to vary")
        self._check_arms()
        for row in self.parameters:
            row.check_values_or_range()
        keys = [row.key for row in self.parameters]
        if len(set(keys)) < len(keys):
            twice = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"parameters.{twice} is given twice")
        if self.deployment is not None and "/" not in self.deployment:
            raise ValueError(f"deployment '{self.deployment}' must be '<flow name>/<deployment name>'")
        for point in self.optuna.enqueue:
            unknown = sorted(set(point) - set(keys))
            if unknown:
                raise ValueError(f"optuna.enqueue names '{unknown[0]}', which is not one of the sweep's parameters")
        for key, values in self.axes.items():
            check_key(key)
            check_axis(key, values, self.method)
        return self

    def _check_arms(self) -> None:
        if not self.arms:
            return
        if self.method != "grid":
            raise ValueError(f"arms need method: grid (sweep '{self.name}' has method: {self.method})")
        names = [arm.name for arm in self.arms]
        if len(set(names)) < len(names):
            raise ValueError(f"arms: the name '{next(n for n in names if names.count(n) > 1)}' is given twice")
        swept = {row.key for row in self.parameters}
        for arm in self.arms:
            for key in arm.overrides:
                if key in swept:
                    raise ValueError(f"arms.{arm.name} sets {key}, which is also one of the sweep's parameters")
                try:
                    check_key(key)
                except ValueError as err:
                    raise ValueError(f"arms.{arm.name}: {err}") from None


def check_axis(key: str, values: list[Any] | Range, method: str) -> None:
    """Raise ValueError unless the values (or range) of parameter `key` can be searched by `method`."""
    if isinstance(values, Range):
        if method == "grid":
            raise ValueError(
                f"parameters.{key} is a range, which needs method: random or optuna (a grid needs a list of values)"
            )
        if not values.low < values.high:
            raise ValueError(f"parameters.{key}: low ({values.low}) must be below high ({values.high})")
        if values.log and values.low <= 0:
            raise ValueError(f"parameters.{key}: a log range needs low > 0 (got {values.low})")
    elif not values:
        raise ValueError(f"parameters.{key} is an empty list; give at least one value")
    elif method == "optuna" and not all(isinstance(v, SCALARS) or v is None for v in values):
        raise ValueError(f"parameters.{key}: Optuna chooses among numbers, strings, booleans or null only")


class Variant(NamedTuple):
    """One point of the space: its index, a readable label and the overrides it applies (with its arm's, if any)."""

    index: int
    label: str
    overrides: dict[str, Any]
    arm: str | None = None


def check_key(key: str) -> None:
    """Raise ValueError unless `key` is a dotted path to a leaf field of PipelineConfig that a sweep may vary."""
    if key.split(".")[0] in FIXED_PREFIXES:
        raise ValueError(f"parameters.{key}: a sweep cannot vary {key.split('.')[0]} (all variants share it)")
    model: type[BaseModel] = PipelineConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        where = ".".join(parts[:i]) or "the config"
        if field is None:
            raise ValueError(f"parameters.{key} is not a config key ({where} has no field '{part}')")
        annotation = field.annotation
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if i < len(parts) - 1:
            if not is_section:
                raise ValueError(f"parameters.{key} is not a config key ('{'.'.join(parts[: i + 1])}' is a value)")
            model = annotation
        elif is_section:
            raise ValueError(f"parameters.{key} is a config section; name one of its fields")


def parse_space(raw: Any, source: str = "sweep space") -> SweepSpace:
    """Validate a raw mapping (from YAML or the Prefect form); problems become one ConfigError sentence."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must hold a mapping with name, method and parameters")
    parameters = raw.get("parameters")
    for key, values in (parameters if isinstance(parameters, dict) else {}).items():
        if not isinstance(values, (list, dict)):
            raise ConfigError(
                f"{source}: parameters.{key} must be a list of values (grid) or {{low, high, log}} (random), "
                f"not {values!r}"
            )
        if isinstance(values, dict):
            unknown = sorted(set(values) - set(Range.model_fields))
            missing = sorted({"low", "high"} - set(values))
            if unknown or missing:
                problem = f"has unknown key '{unknown[0]}'" if unknown else f"needs '{missing[0]}'"
                raise ConfigError(f"{source}: parameters.{key} {problem} (a range is {{low, high, log, integer}})")
    try:
        return SweepSpace.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def load_space(path: str | Path) -> SweepSpace:
    """Read and validate a sweep space YAML file."""
    return parse_space(read_yaml(path, "sweep space file"), str(path))


def _round(value: float) -> float:
    """Six significant digits: readable labels, and the same draw prints the same everywhere."""
    return float(f"{value:.6g}")


def _draw(rng: random.Random, values: list[Any] | Range) -> Any:
    if isinstance(values, list):
        return values[rng.randrange(len(values))]
    if values.log:
        x = math.exp(rng.uniform(math.log(values.low), math.log(values.high)))
    else:
        x = rng.uniform(values.low, values.high)
    return int(round(x)) if values.integer else _round(x)


def label(overrides: dict[str, Any]) -> str:
    """``{'ppo.kl_coef': 0.1}`` -> ``'ppo.kl_coef=0.1'``."""
    return ",".join(f"{k}={v}" for k, v in overrides.items())


def expand(space: SweepSpace) -> list[Variant]:
    """The variants of a space: the grid's combinations in order, or `trials` seeded draws (not for optuna)."""
    axes = space.axes
    keys = list(axes)
    if space.method == "grid":
        combos = itertools.product(*(axes[k] for k in keys))
        points = [dict(zip(keys, combo, strict=True)) for combo in combos]
    else:
        if space.method != "random":
            raise ValueError(f"method {space.method} asks its trials one by one (rlhf.sweeps.optuna_search)")
        rng = random.Random(space.seed)
        points = []
        for _ in range(space.trials):
            # draw in sorted key order, so reordering the YAML does not change the variants
            draw = {k: _draw(rng, axes[k]) for k in sorted(keys)}
            points.append({k: draw[k] for k in keys})
    if space.arms:  # every arm at every point, arm by arm
        return [
            Variant(i, ",".join([arm.name, *([label(point)] if point else [])]), {**arm.overrides, **point}, arm.name)
            for i, (arm, point) in enumerate((arm, point) for arm in space.arms for point in points)
        ]
    return [Variant(i, label(p), p) for i, p in enumerate(points)]


def variant_config(base: PipelineConfig, space: SweepSpace, variant: Variant) -> PipelineConfig:
    """The base config with the variant's overrides applied, validated; its run is named after the sweep."""
    raw = base.model_dump(mode="json")
    raw = apply_overrides(raw, [f"{k}={_yaml_value(v)}" for k, v in variant.overrides.items()])
    raw["run_name"] = f"{space.name}-{variant.index:02d}"
    return build_config(raw, f"sweep '{space.name}' variant {variant.index} ({variant.label})")


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def variant_configs(base: PipelineConfig, space: SweepSpace) -> list[tuple[Variant, PipelineConfig]]:
    """Every variant with its config; any variant the config rejects is an error before anything runs."""
    return [(v, variant_config(base, space, v)) for v in expand(space)]


class Planned(NamedTuple):
    """A variant ready to run: its config (None when the config rejects the point: `error` says why) and, for Optuna,
    the trial it reports to (a `rlhf.sweeps.optuna_search.TrialRef`)."""

    variant: Variant
    config: PipelineConfig | None
    trial: Any = None
    error: str | None = None


class VariantList:
    """The variants of a grid or random sweep, handed out in order (the flow's side of `OptunaSearch`)."""

    def __init__(self, base: PipelineConfig, space: SweepSpace) -> None:
        self._planned = [Planned(v, config) for v, config in variant_configs(base, space)]
        self.total = len(self._planned)
        self.configs = [p.config for p in self._planned]  # every variant, validated before anything runs

    def next(self) -> Planned | None:
        return self._planned.pop(0) if self._planned else None

    def tell(self, planned: Planned, status: str, value: float | None, mlflow_run_id: str | None) -> None:
        """Nothing to learn from an outcome: the variants were fixed in advance."""

    def kept(self) -> list[dict[str, Any]]:
        return []
