"""The one module that talks to MLflow.

Everything goes through an explicit run id (MLflow's active run is thread-local, and Prefect may run a task in
another thread), using ``MlflowClient``. The default store is SQLite inside ``mlruns/`` with artifacts there too
(MLflow >= 3.13 refuses the plain ``./mlruns`` file store).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd

from rlhf.metrics import earlier_metric_names
from rlhf.tracking.default_view import experiment_tags
from rlhf.tracking.metrics_writer import BatchedLog, LogFn, StepRecord
from rlhf.tracking.model_logging import fluent_tracking_uri, hub_card_warnings_off, no_requirement_check
from rlhf.tracking.store import (  # noqa: F401 (RUN_TYPE_TAG, RunRecord, the source tags: imported from here)
    _CHECKOUT,
    HOST_TAG,
    PID_TAG,
    RUN_TYPE_TAG,
    SOURCE_NAME_TAG,
    SOURCE_TYPE_TAG,
    RetryingClient,
    RunRecord,
    as_uri,
    default_source,
    parquet_digest,
    process_alive,
    process_tags,
    resolve_tracking_uri,
    source_tags,
    start_from_empty_store,
    store_lock,
)

MAX_PARAM_LEN = 6000
MAX_TAG_LEN = 5000  # a description longer than this is cut (MLflow caps tag values at 5000 to 8000 by version)
_logger = logging.getLogger(__name__)
_FLUENT_LOCK = threading.Lock()

# Arrow type -> MLflow column type, for the schema of dataset inputs.
_MLFLOW_TYPES = {
    "string": "string",
    "large_string": "string",
    "double": "double",
    "float": "float",
    "int64": "long",
    "int32": "integer",
    "bool": "boolean",
    "binary": "binary",
}


def _start_from_empty_store(uri: str) -> bool:
    from mlflow.tracking import MlflowClient

    return start_from_empty_store(uri, lambda new: MlflowClient(tracking_uri=new).search_experiments())


def prepare_store(uri: str) -> None:
    """A ``sqlite:///`` store that does not exist yet, made from the empty store (`start_from_empty_store`), before
    an MLflow server or UI of another process opens it; other stores are left alone."""
    uri = resolve_tracking_uri(uri)
    with store_lock(uri):
        _start_from_empty_store(uri)


class Tracker:
    """Runs, params, metrics and artifacts of one MLflow experiment."""

    def __init__(self, uri: str, experiment: str, artifact_location: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.uri = resolve_tracking_uri(uri)
        # (key, step) already logged in a reopened run: a resumed stage does not log a step twice
        self._logged: dict[str, set[tuple[str, int]]] = {}
        self._batched: dict[str, list[BatchedLog]] = {}  # the batched metric loggers of each run (end_run flushes)
        with store_lock(self.uri):  # the client creates (migrates) the store: one process at a time
            _start_from_empty_store(self.uri)
            self.client = RetryingClient(MlflowClient(tracking_uri=self.uri))
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                location = as_uri(artifact_location) if artifact_location else None
                self.experiment_id = self._create_experiment(experiment, location)
            else:
                self.experiment_id = found.experiment_id
            for key, value in experiment_tags().items():  # the UI's default view and the experiment's kind
                if found is None or found.tags.get(key) != value:
                    self.client.set_experiment_tag(self.experiment_id, key, value)

    def _create_experiment(self, name: str, location: str | None) -> str:
        """Create the experiment, or read back the id of the one another process created meanwhile: runs started
        together on a tracking server race here (`make bench-store` saw all but one fail without this)."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException as err:
            found = self.client.get_experiment_by_name(name) if err.error_code == "RESOURCE_ALREADY_EXISTS" else None
            if found is None:
                raise
            return found.experiment_id

    def start_run(self, name: str, parent_run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
        """A new run; its MLflow source (`source_tags`) is the one in `tags`, else its parent's, else
        `default_source()`."""
        all_tags = {**process_tags(), **(tags or {})}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        if SOURCE_NAME_TAG not in all_tags:
            parent = self.client.get_run(parent_run_id).data.tags if parent_run_id else {}
            all_tags |= source_tags(parent.get(SOURCE_NAME_TAG) or default_source())
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return run.info.run_id

    def source_of(self, run_id: str) -> dict[str, str]:
        """The MLflow source tags of a run (`default_source()` for a run without them)."""
        tags = self.client.get_run(run_id).data.tags
        return {
            SOURCE_NAME_TAG: tags.get(SOURCE_NAME_TAG) or default_source(),
            SOURCE_TYPE_TAG: tags.get(SOURCE_TYPE_TAG) or "LOCAL",
        }

    def reopen_run(self, run_id: str) -> None:
        """Mark a failed, killed or finished run as running again (a retried or rerun stage continues its own run),
        in this process; the steps it logged already are not logged again."""
        self.client.update_run(run_id, status="RUNNING")
        self.set_tags(run_id, process_tags())
        logged = set()
        for key in self.client.get_run(run_id).data.metrics:
            logged |= {(key, m.step) for m in self.client.get_metric_history(run_id, key)}
        self._logged[run_id] = logged

    def end_orphaned_runs(self) -> list[str]:
        """Mark KILLED the RUNNING runs of this experiment started on this host by a process that is gone (killed
        with SIGKILL, or its machine lost power): runs of processes still alive, or of other hosts, are left
        alone. Returns their ids."""
        this_host = process_tags()[HOST_TAG]
        ended = []
        for run in self.search_runs("attributes.status = 'RUNNING'"):
            pid = run.tags.get(PID_TAG, "")
            if run.tags.get(HOST_TAG) == this_host and pid.isdigit() and not process_alive(int(pid)):
                self.client.set_terminated(run.run_id, status="KILLED")
                ended.append(run.run_id)
        return ended

    def end_run(self, run_id: str, failed: bool = False, killed: bool = False) -> None:
        """End a run FINISHED, FAILED, or KILLED (stopped on purpose, e.g. a trial its sweep's pruner stopped), once
        its batched metric loggers' steps are written (and their writer threads stopped). A run whose steps cannot
        be written ends FAILED, and the error is raised (unless the run failed already: its own error is the one
        on its way up, and this one is only logged)."""
        errors = []
        for batched in self._batched.pop(run_id, []):
            try:
                batched.close()
            except Exception as err:  # noqa: BLE001 (the run is ended all the same)
                errors.append(err)
        status = "KILLED" if killed else "FAILED" if failed or errors else "FINISHED"
        self.client.set_terminated(run_id, status=status)
        for err in errors if failed or killed else errors[1:]:
            _logger.warning("metrics of MLflow run %s could not be written: %s", run_id, err)
        if errors and not (failed or killed):
            raise errors[0]

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def set_description(self, run_id: str, text: str) -> None:
        """The run's description in the MLflow UI (the ``mlflow.note.content`` tag), Markdown."""
        self.set_tags(run_id, {"mlflow.note.content": text[:MAX_TAG_LEN]})

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[start : start + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        self.log_steps(run_id, [(metrics, step, time.time())])

    def log_steps(self, run_id: str, steps: list[StepRecord]) -> None:
        """Several steps' metrics, each with the time it was logged at, in as few store transactions as can be.
        NaN and inf are logged as they are (MLflow stores them): a diverged loss must show, not vanish."""
        from mlflow.entities import Metric

        logged = self._logged.get(run_id, set())
        items = [
            Metric(k, float(v), round(at * 1000), step)
            for metrics, step, at in steps
            for k, v in metrics.items()
            if v is not None and (k, step) not in logged
        ]
        for start in range(0, len(items), 1000):  # MLflow's limit per batch
            self.client.log_batch(run_id, metrics=items[start : start + 1000])

    def copy_metrics(self, source_run_id: str, run_id: str, keys: list[str]) -> None:
        """Every step of `keys` logged on one run, logged on another too (in batches, with their times)."""
        history = [m for k in keys for m in self.client.get_metric_history(source_run_id, k)]
        self.log_steps(run_id, [({m.key: m.value}, m.step, m.timestamp / 1000) for m in history])

    def metric_logger(
        self, run_id: str, also: LogFn | None = None, every_s: float = 0.0, background: bool = False
    ) -> LogFn:
        """A ``log(metrics, step)`` callable for the library's training loops; with `every_s` > 0 a `BatchedLog`
        (steps written every `every_s` seconds, before each resume state and by `end_run`), with `background` by a
        writer thread of its own, so that the training loop does not wait on the store."""
        batched = BatchedLog(lambda steps: self.log_steps(run_id, steps), every_s, also, background)
        if every_s > 0 or background:  # every_s 0 and no thread: each step written at once
            self._batched.setdefault(run_id, []).append(batched)
        return batched

    def log_artifacts(self, run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
        local_path = Path(local_path)
        if local_path.is_dir():
            self.client.log_artifacts(run_id, str(local_path), artifact_path)
        elif local_path.is_file():
            self.client.log_artifact(run_id, str(local_path), artifact_path)

    def download_artifact(self, run_id: str, path: str, dst_dir: str | Path) -> Path | None:
        """The run's artifact `path` copied into `dst_dir`; None when the run has no such artifact."""
        if path not in {a.path for a in self.client.list_artifacts(run_id)}:
            return None
        Path(dst_dir).mkdir(parents=True, exist_ok=True)
        return Path(self.client.download_artifacts(run_id, path, str(dst_dir)))

    def log_table(self, run_id: str, frame: pd.DataFrame, artifact_file: str) -> None:
        self.client.log_table(run_id, data=frame, artifact_file=artifact_file)

    def log_parquet_inputs(self, run_id: str, files: list[tuple[str | Path, str, str]], digest: str) -> None:
        """Record Parquet files as dataset inputs of a run: `files` is (path, name, context) triples, `digest` the
        content digest of the prepared data folder (an input tag, ``rlhf.prepared_digest``). Each dataset's own
        digest is its file's content digest (SHA-256, computed once per file version), so the four prepared files
        are told apart. Schema and row count come from the Parquet footer: no rows are parsed."""
        import json

        import pyarrow.parquet as pq
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = []
        for path, name, context in files:
            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
            nulls = [0] * len(schema)
            for group in range(meta.num_row_groups):
                for column in range(len(schema)):
                    stats = meta.row_group(group).column(column).statistics
                    nulls[column] += stats.null_count if stats is not None and stats.has_null_count else 1
            colspec = [
                {"type": _MLFLOW_TYPES.get(str(f.type), str(f.type)), "name": f.name, "required": n == 0}
                for f, n in zip(schema, nulls, strict=True)
            ]
            dataset = Dataset(
                name=name,
                digest=parquet_digest(path)[:36],
                source_type="local",
                source=json.dumps({"uri": str(Path(path).resolve())}),
                schema=json.dumps({"mlflow_colspec": colspec}),
                profile=json.dumps({"num_rows": meta.num_rows, "num_elements": meta.num_rows * len(schema)}),
            )
            tags = [InputTag("mlflow.data.context", context), InputTag("rlhf.prepared_digest", digest)]
            inputs.append(DatasetInput(dataset, tags))
        self.client.log_inputs(run_id, datasets=inputs)

    def log_transformers_model(self, run_id: str, folder: str | Path, name: str = "policy_model") -> str:
        """Log a ``save_pretrained`` folder of a causal LM (with its tokenizer) as an MLflow transformers model of
        the run (a text-generation pipeline): it shows in the run's Models column, and ``mlflow models serve`` and
        ``mlflow.transformers.load_model`` work on it. The model is loaded on the CPU to be logged; its source is
        the run's (MLflow would name the file Python started). Returns the model URI (``models:/m-...``)."""
        import mlflow
        import torch
        import transformers

        pipeline = transformers.pipeline("text-generation", model=str(folder), device="cpu")
        requirements = [f"transformers=={transformers.__version__}", f"torch=={torch.__version__.split('+')[0]}"]
        # the fluent API's tracking URI is global to the process: set for this call only, then restored as it was,
        # an exported MLFLOW_TRACKING_URI included
        source = self.source_of(run_id)
        with (
            _FLUENT_LOCK,
            fluent_tracking_uri(self.uri),
            mlflow.start_run(run_id=run_id),
            hub_card_warnings_off(),
            no_requirement_check(),
        ):
            info = mlflow.transformers.log_model(pipeline, name=name, pip_requirements=requirements, tags=source)
        self.client.update_run(run_id, status="RUNNING")  # leaving start_run ended it; the stage ends it
        return info.model_uri

    def register_model_version(
        self, name: str, run_id: str, artifact_path: str, tags: dict[str, Any], description: str = ""
    ) -> str:
        """A version of registered model `name` pointing at `runs:/<run_id>/<artifact_path>`; the existing version
        when that run was registered already (a cached result is not registered twice). Returns the version."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        for version in self.client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
            if version.source.endswith(artifact_path):
                return str(version.version)
        created = self.client.create_model_version(
            name,
            f"runs:/{run_id}/{artifact_path}",
            run_id,
            tags={k: str(v) for k, v in tags.items()},
            description=description,
        )
        return str(created.version)

    def get_run(self, run_id: str):
        return self.client.get_run(run_id)

    def ui_command(self) -> str:
        return f"mlflow ui --backend-store-uri {self.uri} --host 127.0.0.1 --port 5000"

    # -- Queries for comparing runs, and grouping sweep variants (used by rlhf.sweeps.compare and flows/sweep.py) --

    def search_runs(self, filter_string: str = "", max_results: int | None = None) -> list[RunRecord]:
        """Runs of this experiment matching an MLflow filter string, newest first (all pages)."""
        records: list[RunRecord] = []
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=filter_string,
                max_results=min(1000, max_results or 1000),
                order_by=["attributes.start_time DESC"],
                page_token=token,
            )
            records += [RunRecord.from_run(run) for run in page]
            token = page.token
            if not token or (max_results is not None and len(records) >= max_results):
                return records[:max_results] if max_results is not None else records

    def pipeline_run_of_flow_run(self, flow_run_id: str) -> str | None:
        """The pipeline (parent) run that a Prefect flow run opened, if it got that far."""
        found = self.search_runs(f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
        runs = [r for r in found if r.is_pipeline_run]
        return runs[0].run_id if runs else None

    def pipeline_runs(self, max_results: int | None = None) -> list[RunRecord]:
        """The pipeline (parent) runs: neither stage child runs nor sweep runs."""
        found = [r for r in self.search_runs(max_results=None) if r.is_pipeline_run]
        return found[:max_results] if max_results is not None else found

    def child_runs(self, parent_run_id: str, stage: str | None = None) -> list[RunRecord]:
        """Child runs of a run (tag ``mlflow.parentRunId``), optionally only those of one stage."""
        query = f"tags.`mlflow.parentRunId` = '{parent_run_id}'"
        if stage is not None:
            query += f" AND tags.stage = '{stage}'"
        return self.search_runs(query)

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """``[(step, value), ...]`` of one metric of a run, in step order (its earlier name for a run logged before)."""
        for name in (key, *earlier_metric_names(key)):
            if history := self.client.get_metric_history(run_id, name):
                break
        return sorted((m.step, m.value) for m in history)

    def metric_histories(self, run_id: str, keys: list[str]) -> pd.DataFrame:
        """Several metrics of a run side by side: one row per step any of them was logged at (column ``step``, in
        order), one column per key (NaN where a key has no value at that step)."""
        columns = {key: dict(self.metric_history(run_id, key)) for key in keys}
        steps = sorted({step for values in columns.values() for step in values})
        frame = pd.DataFrame(
            {"step": steps, **{k: [v.get(s, float("nan")) for s in steps] for k, v in columns.items()}}
        )
        return frame.astype({"step": int})

    def attach_to_sweep(self, run_id: str, sweep_run_id: str, sweep_name: str, variant: str) -> None:
        """Group a pipeline run under a sweep run: tagged with the sweep, and nested under it in the MLflow UI."""
        self.set_tags(
            run_id,
            {
                "sweep_run_id": sweep_run_id,
                "sweep.name": sweep_name,
                "sweep.variant": variant,
                "mlflow.parentRunId": sweep_run_id,
            },
        )


def experiment_names(uri: str) -> list[str]:
    """Names of the experiments in a tracking store (creates nothing)."""
    from mlflow.tracking import MlflowClient

    return [e.name for e in MlflowClient(tracking_uri=resolve_tracking_uri(uri)).search_experiments()]
