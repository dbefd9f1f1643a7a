"""Optuna search for sweeps (``method: optuna``): the study, the points its trials ask for, and pruning reports.

The study lives in a database (SQLite ``optuna.db`` next to the MLflow store by default, any SQLAlchemy URL in
``optuna.storage``), named after the sweep. A sweep that is killed and started again opens the same study: its
finished trials (complete, pruned or failed) are kept and counted, and a trial the killed process left running is
marked failed and its point asked again first. One sweep process drives a study at a time.

A trial's pipeline reports PPO's periodic evaluations (``ppo.eval_every``) to the study through
`pruning_reporter`; when the pruner says so, the reporter raises `TrialPruned` and the trial stops. The trial is
found again from `TrialRef`, so the reporting pipeline may run in another process or on another machine (with a
storage that machine can reach).

No Prefect and no MLflow here: the sweep flow (``flows/sweep.py``) asks, runs and tells.
Optuna 5.0's FrozenTrial has no public id, so a killed trial and `TrialRef` read ``trial._trial_id``.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from rlhf.config import PipelineConfig
from rlhf.errors import ConfigError, TrialPruned
from rlhf.sweeps.space import OptunaSettings, Planned, Range, SweepSpace, Variant, label, variant_config

logger = logging.getLogger(__name__)
KILLED_ATTR = "rlhf.killed"  # user attribute of a trial a killed sweep left running (marked failed, asked again)


class TrialRef(BaseModel):
    """Where a running trial is: enough for a pipeline (in any process) to report to it and ask whether to stop."""

    storage: str = Field(description="SQLAlchemy URL of the study's database.")
    study: str = Field(description="Study name (the sweep's name).")
    trial_id: int = Field(description="Optuna's id of the trial in the storage.")
    number: int = Field(description="The trial's number in its study (0, 1, ...).")
    metric: str = Field(description="The periodic-evaluation metric reported, e.g. periodic_eval/gold.")
    settings: OptunaSettings = Field(default_factory=OptunaSettings, description="The study's pruner settings.")


def require_optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            "method: optuna needs the optuna package, which `make install` installs (pip install 'optuna>=4')"
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def default_storage(tracking_uri: str, output_dir: str | Path) -> str:
    """SQLite ``optuna.db`` beside a SQLite MLflow store, else in the output folder."""
    if tracking_uri.startswith("sqlite:///"):
        folder = Path(tracking_uri.removeprefix("sqlite:///")).parent
    else:
        folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder.resolve() / 'optuna.db'}"


def make_pruner(settings: OptunaSettings):
    optuna = require_optuna()
    if settings.pruner == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=settings.n_startup_trials, n_warmup_steps=settings.n_warmup_steps
        )
    if settings.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, settings.n_warmup_steps))
    return optuna.pruners.NopPruner()


def make_sampler(settings: OptunaSettings, seed: int):
    optuna = require_optuna()
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ExperimentalWarning of some TPE options
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(1, settings.n_startup_trials))


def open_study(space: SweepSpace, storage: str):
    """Create the sweep's study, or load it when it exists (a resumed sweep); the enqueued points of a new study are
    queued first."""
    optuna = require_optuna()
    settings = space.optuna
    study = optuna.create_study(
        study_name=space.name,
        storage=storage,
        direction="maximize",
        sampler=make_sampler(settings, space.seed),
        pruner=make_pruner(settings),
        load_if_exists=True,
    )
    if not study.trials:
        for point in settings.enqueue:
            study.enqueue_trial(point)
    return study


def resume(study) -> list[int]:
    """Mark trials left running by a killed sweep failed (user attribute KILLED_ATTR) and queue their points again;
    returns their numbers."""
    optuna = require_optuna()
    killed = []
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        optuna.trial.Trial(study, trial._trial_id).set_user_attr(KILLED_ATTR, True)
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        if trial_point(trial):
            study.enqueue_trial(trial_point(trial))
        killed.append(trial.number)
    return killed


def trial_point(trial) -> dict[str, Any]:
    """The point of a trial: its suggested values, or those it was enqueued with (a trial killed before it was
    given its values has only those)."""
    return {**trial.system_attrs.get("fixed_params", {}), **trial.params}


def finished_trials(study) -> list[Any]:
    """The trials that count towards `trials`: complete, pruned, or failed other than by a killed sweep."""
    optuna = require_optuna()
    states = optuna.trial.TrialState
    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state in (states.COMPLETE, states.PRUNED) or (t.state == states.FAIL and not t.user_attrs.get(KILLED_ATTR))
    ]


def ask(study, space: SweepSpace) -> tuple[Any, dict[str, Any]]:
    """A new trial and its point: {dotted key: value} in the order of the space's parameters."""
    trial = study.ask()
    point: dict[str, Any] = {}
    for key, values in space.axes.items():
        if isinstance(values, Range):
            if values.integer:
                point[key] = trial.suggest_int(key, math.ceil(values.low), math.floor(values.high), log=values.log)
            else:
                point[key] = trial.suggest_float(key, values.low, values.high, log=values.log)
        else:
            point[key] = trial.suggest_categorical(key, values)
    return trial, point


def trial_ref(study, trial, storage: str, metric: str, settings: OptunaSettings) -> TrialRef:
    return TrialRef(
        storage=storage,
        study=study.study_name,
        trial_id=trial._trial_id,
        number=trial.number,
        metric=metric,
        settings=settings,
    )


def tell(study, number: int, status: str, value: float | None) -> None:
    """Finish a trial: 'completed' with its final objective value, 'pruned', or 'failed'."""
    optuna = require_optuna()
    states = optuna.trial.TrialState
    if status == "completed" and value is not None and math.isfinite(value):
        study.tell(number, value)
    elif status == "pruned":
        study.tell(number, state=states.PRUNED)
    else:
        study.tell(number, state=states.FAIL)


def pruning_reporter(ref: TrialRef) -> Callable[[int, dict[str, float]], None]:
    """An ``on_eval(step, metrics)`` for PPO: reports `ref.metric` at each periodic evaluation and raises
    `TrialPruned` when the study's pruner stops the trial."""
    optuna = require_optuna()
    study = optuna.load_study(study_name=ref.study, storage=ref.storage, pruner=make_pruner(ref.settings))
    trial = optuna.trial.Trial(study, ref.trial_id)

    def on_eval(step: int, metrics: dict[str, float]) -> None:
        value = metrics.get(ref.metric)
        if value is None or not math.isfinite(value):
            return  # no such metric (no gold reward) or not finite: the trainer's own checks deal with it
        trial.report(float(value), step)
        if trial.should_prune():
            raise TrialPruned(
                f"Optuna pruned trial {ref.number} of study '{ref.study}' at PPO update {step}: "
                f"{ref.metric} = {value:.4g} is below the pruner's bar"
            )

    return on_eval


def study_table(study) -> list[dict[str, Any]]:
    """One row per trial: number, state, value, its point, and the last intermediate value's step."""
    rows = []
    for trial in study.get_trials(deepcopy=False):
        rows.append(
            {
                "trial": trial.number,
                "state": trial.state.name.lower(),
                "value": trial.value,
                "point": label(trial.params),
                "last_step": max(trial.intermediate_values, default=None),
            }
        )
    return rows


def study_plots(study, folder: str | Path) -> list[Path]:
    """Optuna's own figures of the study (optimisation history, intermediate values, parameter importances) as
    PNG files; a figure Optuna cannot draw yet (e.g. importances of fewer than two finished trials) is skipped."""
    optuna = require_optuna()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    figures = {
        "optuna_history.png": vis.plot_optimization_history,
        "optuna_intermediate_values.png": vis.plot_intermediate_values,
        "optuna_param_importances.png": vis.plot_param_importances,
    }
    for name, plot in figures.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                ax = plot(study)
            figure = (ax[0] if hasattr(ax, "__len__") else ax).get_figure()
            figure.set_size_inches(8, 5)
            figure.tight_layout()
            figure.savefig(folder / name, dpi=110)
            plt.close(figure)
            written.append(folder / name)
        except Exception as err:  # noqa: BLE001 (a figure Optuna cannot draw for this study is skipped)
            logger.info("Optuna figure %s skipped: %s", name, err)
    return written


SWEEP_RUN_ATTR, MLFLOW_RUN_ATTR, RUN_NAME_ATTR = "mlflow_sweep_run_id", "mlflow_run_id", "run_name"


class OptunaSearch:
    """The trials of an Optuna sweep, asked one at a time and told their outcomes (`VariantList`'s interface).

    `objective`: the final metric told for a completed trial (e.g. eval/policy_gold); `metric`: the periodic-evaluation
    metric its PPO stage reports for pruning (e.g. periodic_eval/gold)."""

    def __init__(self, base: PipelineConfig, space: SweepSpace, storage: str, objective: str, metric: str) -> None:
        base = with_periodic_eval(base, space)
        self.base, self.space, self.storage = base, space, storage
        self.objective, self.metric = objective, metric
        self.configs = check_points(base, space)
        self.study = open_study(space, storage)
        self.killed = resume(self.study)
        self.finished_before = finished_trials(self.study)
        self.total = max(0, space.trials - len(self.finished_before))
        self.asked = 0

    @property
    def sweep_run_id(self) -> str | None:
        """The MLflow sweep run of an earlier, killed start of this sweep (None for a new study)."""
        return self.study.user_attrs.get(SWEEP_RUN_ATTR)

    def remember_sweep_run(self, run_id: str) -> None:
        self.study.set_user_attr(SWEEP_RUN_ATTR, run_id)

    def next(self) -> Planned | None:
        if self.asked >= self.total:
            return None
        self.asked += 1
        trial, point = ask(self.study, self.space)
        variant = Variant(trial.number, label(point), point)
        try:
            config = variant_config(self.base, self.space, variant)
        except ConfigError as err:
            return Planned(variant, None, error=str(err))
        trial.set_user_attr(RUN_NAME_ATTR, config.run_name)
        return Planned(variant, config, trial_ref(self.study, trial, self.storage, self.metric, self.space.optuna))

    def tell(self, planned: Planned, status: str, value: float | None, mlflow_run_id: str | None) -> None:
        if planned.trial is not None and mlflow_run_id:
            require_optuna().trial.Trial(self.study, planned.trial.trial_id).set_user_attr(
                MLFLOW_RUN_ATTR, mlflow_run_id
            )
        tell(self.study, planned.variant.index, status, value)

    def kept(self) -> list[dict[str, Any]]:
        """Rows of the trials an earlier start of this sweep finished: variant, point, status, MLflow run."""
        status = {"complete": "completed", "pruned": "pruned", "fail": "failed"}
        return [
            {
                "variant": t.user_attrs.get(RUN_NAME_ATTR, f"{self.space.name}-{t.number:02d}"),
                **t.params,
                "status": status[t.state.name.lower()],
                "mlflow_run_id": t.user_attrs.get(MLFLOW_RUN_ATTR),
                "trial": t.number,
            }
            for t in self.finished_before
        ]


def with_periodic_eval(base: PipelineConfig, space: SweepSpace) -> PipelineConfig:
    """A pruner reads PPO's periodic evaluations: when the base config has none (ppo.eval_every 0), evaluate every
    tenth of training (at least every update)."""
    if space.optuna.pruner == "none" or base.ppo.eval_every > 0 or "ppo.eval_every" in space.axes:
        return base
    every = max(1, base.ppo.num_updates // 10)
    logger.warning("sweep '%s' prunes trials: PPO evaluates every %d updates (ppo.eval_every was 0)", space.name, every)
    return base.model_copy(update={"ppo": base.ppo.model_copy(update={"eval_every": every})})


def check_points(base: PipelineConfig, space: SweepSpace) -> list[PipelineConfig]:
    """The base config with each parameter at each of its choices (or bounds of its range), validated: a value the
    config rejects is an error before the study starts."""
    base = with_periodic_eval(base, space)
    configs = []
    for key, values in space.axes.items():
        candidates = [values.low, values.high] if isinstance(values, Range) else values
        for value in candidates:
            if isinstance(values, Range) and values.integer:
                value = int(value)
            configs.append(variant_config(base, space, Variant(0, f"{key}={value}", {key: value})))
    return configs
