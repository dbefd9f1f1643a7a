"""Content-addressed cache keys and output folders for the pipeline's Prefect tasks.

A stage's key is a digest of: its name, the config sections it reads, the runtime settings that change its numbers
(`runtime_key`), the content digests of its upstream outputs and the version (source digest) of the library and task
code. The same key names the stage's output folder,
so a cached Prefect result always points at files that were written for exactly those inputs. Both come from the
task's own name and parameters through `stage_key`: the cache key (`content_cache_key`), the folder a running task
writes (`current_stage_dir`) and the folder `run_stage` checks before calling it. Cached results are only used while
those files are still complete: otherwise the task is re-run with ``refresh_cache``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency
from prefect.context import TagsContext, TaskRunContext
from prefect.exceptions import ObjectNotFound
from prefect.utilities.callables import get_call_parameters
from pydantic import BaseModel

import rlhf
import tasks
from rlhf.checkpoints import is_complete, stage_lock
from rlhf.config import EvalConfig, PPOConfig, RuntimeConfig
from rlhf.stages import GPU_TAG, INIT, PPO, PREPARE
from rlhf.stop_request import raise_if_stop_requested
from tasks.faults import busy_server_in_one_sentence
from tasks.outputs import StageOutput
from tasks.progress import task_logger
from tasks.slot_watch import watch_slots

# Parameters that never change a stage's result, so they are left out of its key (`trial`: the sweep trial a PPO
# stage reports to; a pruned stage raises and caches nothing). `runtime` is in it through `runtime_key`: the
# settings that change the numbers only.
NOT_IN_KEY = {"tracking", "trial"}
# What of `runtime` is in every stage's key: the settings that change a stage's numbers. The device type (CPU and CUDA
# kernels differ; cuda:0 and cuda:1 do not), the compute dtype ('auto' resolved where that needs no GPU: on a CPU,
# float32 or bfloat16 as this machine's cached check says, rlhf/models/cpu_bf16.py) and the attention kernel (sdpa,
# eager and flash-attention compute attention differently). Left out: `threads` and the device index (the same
# kernels, at most the order of a float reduction: the machine's core count or BLAS build, not in any key either,
# changes as much), `trust_remote_code` (a permission: the same model or none), `on_nonfinite` (the same numbers while
# every step is finite; a stopped stage caches nothing, and its rerun with skip_update must resume from the state the
# stop kept), `output_dir` (where the cache is), `device_slot`, `progress`, `memory_check` and `memory_budget_gb`
# (scheduling, display, preflight), `ppo_processes` (PPO's key has it as `processes`).
RUNTIME_IN_KEY = ("device", "dtype", "attn_implementation")
# Stages whose key also holds `runtime.sharding`: PPO's resume state is a torch.distributed.checkpoint folder under
# 'fsdp' and a torch.save file otherwise, and its gradients are reduce-scattered rather than all-reduced.
SHARDED_STAGES = {PPO.task}
# Stages whose key also holds `runtime.compile_training`: the compiled training forwards fuse kernels, which moves
# log-probs by about 1e-6 (as the attention kernel does).
COMPILED_STAGES = {PPO.task}
# Stages that compute nothing with a model (data preparation; the plan of the PPO models reads tokenizers only): no
# runtime setting changes what they write. Any other stage, a new one too, has RUNTIME_IN_KEY in its key.
MODEL_FREE_STAGES = {PREPARE.task, INIT.task}
SFT_SIDE = "sft_side"  # the evaluation's SFT side's folder and key name (`sft_side_dir`)
# What of ppo.* the evaluation's sampling reads (rlhf.eval.evaluate.evaluate_policies), in its SFT side's key
EVAL_SAMPLING_KEYS = (
    "max_new_tokens", "temperature", "top_k", "top_p", "stop_tokens", "max_prompt_tokens", "generation",
)  # fmt: skip
# The packages whose source decides a stage's result: the library, and the task bodies (what they write and log).
CODE_PACKAGES = (Path(rlhf.__file__).parent, Path(tasks.__file__).parent)


def source_digest(*packages: Path) -> str:
    """Digest of the Python files under the package folders (with their paths inside the packages' parent)."""
    h = hashlib.sha256()
    for root in packages:
        for file in sorted(root.rglob("*.py")):
            h.update(str(file.relative_to(root.parent)).encode())
            h.update(file.read_bytes())
    return h.hexdigest()[:16]


@cache
def code_version() -> str:
    """Digest of the library's and the task layer's source: a code change invalidates the cached stages."""
    return source_digest(*CODE_PACKAGES)


def runtime_key(stage: str, runtime: RuntimeConfig) -> dict[str, Any]:
    """The settings of `runtime` that change `stage`'s numbers (RUNTIME_IN_KEY, SHARDED_STAGES' sharding and
    COMPILED_STAGES' compile_training; none for MODEL_FREE_STAGES)."""
    if stage in MODEL_FREE_STAGES:
        return {}
    device = "cuda" if runtime.device.startswith("cuda") else runtime.device
    if device == "auto":
        import torch  # heavy: only where 'auto' must be resolved

        device = "cuda" if torch.cuda.is_available() else "cpu"
    # 'auto' on a CPU: what it resolves to on this machine at the model's width (its cached check); on a GPU it stays
    # 'auto' (bfloat16 where supported): asking needs a CUDA context
    dtype = runtime.dtype
    if device == "cpu" and dtype == "auto":
        from rlhf.models.device import resolved_dtype_name  # heavy: torch

        dtype = resolved_dtype_name(dtype, "cpu", runtime.model_width)
    key = {"device": device, "dtype": dtype, "attn_implementation": runtime.attn_implementation}
    if stage in SHARDED_STAGES:
        key["sharding"] = runtime.sharding
    if stage in COMPILED_STAGES and runtime.compile_training:  # off: the keys of runs from before the setting
        key["compile_training"] = True
    return key


def _key_part(stage: str, value: Any) -> Any:
    if isinstance(value, StageOutput):
        return value.digest
    if isinstance(value, RuntimeConfig):
        return runtime_key(stage, value)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):  # a list of stage outputs (an ensemble's members): their digests
        return [_key_part(stage, item) for item in value]
    return value


def stage_key(stage: str, parameters: dict[str, Any]) -> str:
    """`<stage>-<digest>`: the digest of the stage's name, the code version and its parameters (not NOT_IN_KEY; of
    the runtime, what `runtime_key` keeps)."""
    parts = {k: _key_part(stage, v) for k, v in sorted(parameters.items()) if k not in NOT_IN_KEY}
    payload = json.dumps({"stage": stage, "code": code_version(), "inputs": parts}, sort_keys=True, default=str)
    return f"{stage}-{hashlib.sha256(payload.encode()).hexdigest()[:20]}"


def stage_dir(stage: str, parameters: dict[str, Any]) -> Path:
    """`<runtime.output_dir>/<stage>/<stage key>`: the output folder of a stage called with these parameters."""
    return Path(parameters["runtime"].output_dir).resolve() / stage / stage_key(stage, parameters)


def sft_side_dir(eval_cfg: EvalConfig, ppo_cfg: PPOConfig, runtime: RuntimeConfig, **inputs: Any) -> Path:
    """`<runtime.output_dir>/sft_side/sft_side-<digest>`: the folder of the evaluation's SFT side
    (`rlhf.eval.sft_side`), named as a stage's is by the digest of `inputs` (the SFT policy, the scorer, the prompts,
    the benchmarks' content), eval.*, the sampling settings the evaluation resolves (eval.max_new_tokens and
    eval.temperature, else ppo.*'s; ppo.*'s other sampling settings, not its training ones: another objective or seed
    shares it) and the runtime's keyed settings."""
    sampling = {key: getattr(ppo_cfg, key) for key in EVAL_SAMPLING_KEYS}
    resolved = ("max_new_tokens", "temperature")
    sampling |= {key: getattr(eval_cfg, key) or sampling[key] for key in resolved}
    # eval.length_tolerance compares the two sides; it changes no response
    evaluation = eval_cfg.model_dump(mode="json", exclude={*resolved, "length_tolerance"})
    return stage_dir(SFT_SIDE, {**inputs, "eval_cfg": evaluation, "sampling": sampling, "runtime": runtime})


def content_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """Prefect cache_key_fn: the stage key (the flow run id is not part of it, so runs share the cache)."""
    return stage_key(context.task.name, parameters)


def current_stage_dir() -> Path:
    """The output folder of the running stage task, from the task name and parameters its cache key is made of."""
    context = TaskRunContext.get()
    if context is None:
        raise RuntimeError("current_stage_dir() is for the body of a running stage task (call the task, not .fn)")
    return stage_dir(context.task.name, context.parameters)


def task_stage_dir(task, **parameters: Any) -> Path:
    """The output folder of `task` called with these keyword arguments (its defaults filled in, as Prefect does)."""
    return stage_dir(task.name, get_call_parameters(task.fn, (), parameters))


def run_stage(task, **parameters: Any) -> Any:
    """Call a stage task; refresh its cache entry when its output folder is missing or incomplete. The result's
    `cached` is true when Prefect served it from its cache.

    The stage's folder is locked meanwhile (`stage_lock`): a second pipeline process (or a concurrent sweep
    variant) on the same output folder waits for the first to finish the stage, then finds it complete and gets the
    cached result. A GPU stage (tag ``gpu``) that computes holds a slot of ``runtime.device_slot`` meanwhile. The task
    runs with those of its tags that have a Prefect concurrency limit (`limited_tags`); one that waits on a slot no
    running task holds says so in one warning (`watch_slots`), and a request for it that the Prefect server kept
    answering 503 stops the run with one sentence (`busy_server_in_one_sentence`)."""
    folder = task_stage_dir(task, **parameters)
    with stage_lock(folder):
        # PPO keeps its resume state beside the final models, which carry the manifest in final/.
        complete = is_complete(folder) or is_complete(folder / "final")
        runtime = parameters.get("runtime")
        slot = getattr(runtime, "device_slot", None) if GPU_TAG in task.tags and not complete else None
        tags = limited_tags(task.tags)
        if tags:
            _forget_no_limit(tags)
        busy, held = busy_server_in_one_sentence(task.name), device_slot(slot, task.name)
        with busy, held, watch_slots(task.name, tags, task_logger()):
            state = task.with_options(refresh_cache=not complete, tags=tags)(**parameters, return_state=True)
        result = state.result()
        if state.name == "Cached" and isinstance(result, StageOutput):
            result = result.model_copy(update={"cached": True})  # shown in the run's table and MLflow tags
        return result


SLOT_POLL_S = 5.0  # a stage waiting for its device slot looks up this often whether its command was stopped


@contextmanager
def device_slot(name: str | None, stage: str = "the stage") -> Iterator[None]:
    """Hold one slot of the Prefect global concurrency limit `name` (one limit per device, made by the sweep that
    set ``runtime.device_slot``); None holds nothing. A wait longer than SLOT_POLL_S is said once in the stage's
    log, and ends at once when the command is stopped (Ctrl-C or SIGTERM: `rlhf.stop_request`), rather than when
    the slot frees: a sweep's variants wait in worker threads, which the signal does not interrupt."""
    if name is None:
        yield
        return
    with ExitStack() as held:
        told = False
        while True:
            try:
                held.enter_context(concurrency(name, occupy=1, timeout_seconds=SLOT_POLL_S))
                break
            except TimeoutError:
                raise_if_stop_requested(f"{stage}, waiting for the device slot {name},")
                if not told:
                    task_logger().info("%s waits for the device slot %s: another stage holds it", stage, name)
                    told = True
        yield


def limited_tags(tags: Iterable[str]) -> set[str]:
    """The tags among `tags` that have a Prefect tag concurrency limit (a limit named ``tag:<tag>``, e.g. the ``gpu``
    limit `flows/serve.py` sets), as the server says now.

    A task that starts asks the server for a slot of each of its tags' limits. Where a tag has none, that request
    has nothing to do, yet on a SQLite server (`make run`'s) it turns a read transaction into a write while the
    server records the same task's start, fails with 'database is locked' (a 503) and is retried 2 s later: a stage
    starting more than 5 s after its tags were last checked (Prefect remembers 'no limit' for 5 s) waited about 2 s
    for nothing, often. A stage therefore runs with only the tags that have a limit, found by a read, which
    never waits on the lock; the others (no limit to honour) are left off its task run."""
    tags = set(tags)
    if not tags:
        return tags
    limited = set()
    with get_client(sync_client=True) as client:
        for tag in sorted(tags):
            try:
                client.read_global_concurrency_limit_by_name(f"tag:{tag}")
            except ObjectNotFound:
                continue
            limited.add(tag)
    return limited


def _forget_no_limit(tags: set[str]) -> None:
    """Drop Prefect's memory that a task run with `tags` (and those of any `prefect.tags` block around it) had no
    limit. Its task engine, having found no limit for a task's tags, skips asking again for 5 s in that process, so a
    stage started within 5 s of a limit's creation (serve's `gpu` limit, one a user sets) would run without taking
    its slot."""
    from prefect.concurrency import services  # the engine's per-process cache: private, hence looked up with care

    names = {f"tag:{tag}" for tag in tags | set(TagsContext.get().current_tags)}
    remembered, lock = getattr(services, "_no_limits_cache", None), getattr(services, "_cache_lock", None)
    if remembered is not None and lock is not None:
        with lock:
            remembered.pop(frozenset(names), None)
