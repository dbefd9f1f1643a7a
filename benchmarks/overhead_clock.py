"""The timing of benchmarks/overhead_bench.py's variant A (the Prefect flow with MLflow): a `Clock` of the seconds
spent inside instrumented calls, and `instrument`, which wraps the Tracker's methods (MLflow), the stages as the flow
runs them, the library calls inside them, the PPO training loop and the Prefect progress logger."""

from __future__ import annotations

import threading
import time
from collections import defaultdict


class Clock:
    """Seconds spent inside instrumented calls, by (stage, what); nested calls of the same kind count once. Calls of
    the metrics writer threads (`rlhf.tracking.metrics_writer.WRITER_THREAD`) count apart (`<what>_writer`): they
    overlap the training thread's work instead of holding it up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.stage = "flow"
        self.in_ppo_loop = False
        self._depth = threading.local()

    def wrap(self, fn, what: str):
        from rlhf.tracking.metrics_writer import WRITER_THREAD

        clock = self

        def timed(*args, **kwargs):
            depth = getattr(clock._depth, what, 0)
            setattr(clock._depth, what, depth + 1)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(clock._depth, what, depth)
                if depth == 0:
                    spent = time.perf_counter() - start
                    kind = f"{what}_writer" if threading.current_thread().name == WRITER_THREAD else what
                    clock.seconds[f"{clock.stage}|{kind}"] += spent
                    clock.seconds[f"{kind}.{fn.__name__}"] += spent
                    clock.seconds[f"{clock.stage}|{kind}.{fn.__name__}"] += spent
                    if what != "library" and getattr(clock._depth, "library", 0):  # a log callback of the library's
                        clock.seconds[f"{clock.stage}|in_library"] += spent
                    if clock.in_ppo_loop:
                        clock.seconds[f"ppo_loop|{kind}"] += spent

        timed.__name__ = fn.__name__
        return timed


def instrument(clock: Clock, times: dict[str, float], outputs: dict) -> None:
    """Time every Tracker method (MLflow), the stages (`run_stage` as the flow calls it), the PPO training loop and
    the Prefect progress logger of the training loops."""
    # heavy, and imported here on purpose: each side's imports are part of what it measures (times["imports"])
    import flows.pipeline as pipeline
    import tasks.stage_runs as stage_runs
    import tasks.stages as stages
    from rlhf.ppo import launch
    from rlhf.tracking.client import Tracker

    for name, value in list(vars(Tracker).items()):
        if callable(value) and (not name.startswith("_") or name == "__init__") and name != "metric_logger":
            setattr(Tracker, name, clock.wrap(value, "mlflow"))

    run_stage = pipeline.run_stage

    def timed_stage(task, **parameters):
        clock.stage = task.name
        start = time.perf_counter()
        try:
            result = run_stage(task, **parameters)
        finally:
            times[task.name] = time.perf_counter() - start
            clock.stage = "flow"
        outputs[task.name] = result
        return result

    pipeline.run_stage = timed_stage
    train_ppo = launch.train_ppo  # the PPO stage's one process trains through rlhf.ppo.launch.train_policy

    def timed_train_ppo(*args, **kwargs):
        clock.in_ppo_loop = True
        start = time.perf_counter()
        try:
            return train_ppo(*args, **kwargs)
        finally:
            times["ppo_loop"] = time.perf_counter() - start
            clock.in_ppo_loop = False

    launch.train_ppo = timed_train_ppo
    # the library calls inside the tasks (what B runs): a stage's time less these is its orchestration overhead
    from rlhf.data import prepare  # heavy (as above)
    from rlhf.eval import evaluate
    from rlhf.train import reward, sft

    for module, name in (
        (prepare, "prepare_preferences"),
        (sft, "bootstrap_sft"),
        (sft, "finetune_sft"),
        (sft, "load_existing"),
        (reward, "train_reward_model"),
        (stages, "member_tokenizers"),
        (stages, "load_tokenizer"),
        (stages, "write_manifest"),
        (launch, "train_ppo"),
        (evaluate, "evaluate_policies"),
    ):
        setattr(module, name, clock.wrap(getattr(module, name), "library"))
    progress_logger = stage_runs.progress_logger  # what a stage's training log reports to Prefect through
    stage_runs.progress_logger = lambda *a, **k: clock.wrap(progress_logger(*a, **k), "prefect_progress")
