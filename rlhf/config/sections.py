"""The run-wide config sections: tracking, runtime and data."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from rlhf.config.base import Section
from rlhf.config.data_tasks import ReasoningTaskConfig, SyntheticTaskConfig

# MLflow's convention: the tracking URI of a process that names none. Where it is set (`rlhf serve` prints it for a
# team's machines), it is the default of tracking.uri; a config file or an override still wins.
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"
LOCAL_ARTIFACTS = "mlruns/artifacts"  # beside the default SQLite store


def default_tracking_uri() -> str:
    """tracking.uri where a config names none: $MLFLOW_TRACKING_URI where set, else the SQLite store in mlruns/."""
    return os.environ.get(TRACKING_URI_ENV) or DEFAULT_TRACKING_URI


def tracking_uri_origin(uri: str) -> str:
    """Where a config's tracking.uri came from, in words: the environment variable, the default, or the config."""
    if uri == os.environ.get(TRACKING_URI_ENV):
        return TRACKING_URI_ENV
    return "the default" if uri == DEFAULT_TRACKING_URI else "tracking.uri"


def is_tracking_server(uri: str) -> bool:
    """An MLflow tracking server (http or https), as opposed to a database or file store of this machine."""
    return uri.startswith(("http://", "https://"))


class TrackingConfig(Section):
    uri: str = Field(
        default_factory=default_tracking_uri,
        description=f"MLflow tracking URI (SQLite file or a server URL). Default: ${TRACKING_URI_ENV} where it is "
        f"set (MLflow's convention; `rlhf serve` prints it for a team's machines), else {DEFAULT_TRACKING_URI}.",
    )
    artifact_location: str | None = Field(
        None,
        description="Where new experiments store artifacts (a local folder or an object-store URI). None: "
        f"{LOCAL_ARTIFACTS} for a store on this machine; the server's own artifact store for a tracking server "
        "(http or https).",
    )
    experiment: str = Field("rlhf-ppo", description="MLflow experiment name.")
    log_checkpoints: bool = Field(True, description="Log every model checkpoint as an MLflow artifact.")
    registered_model: str | None = Field(
        None,
        description="Register each pipeline run's PPO policy as a version of this MLflow registered model (tagged "
        "with the evaluation summary; a cached policy keeps its version). Needs log_checkpoints.",
    )

    @model_validator(mode="after")
    def _local_artifacts_beside_a_local_store(self) -> TrackingConfig:
        if self.artifact_location is None and not is_tracking_server(self.uri):
            self.artifact_location = LOCAL_ARTIFACTS
        return self

    @model_validator(mode="after")
    def _registry_needs_checkpoints(self) -> TrackingConfig:
        if self.registered_model is not None and not self.registered_model.strip():
            raise ValueError("tracking.registered_model must be a non-empty name (or null)")
        if self.registered_model and not self.log_checkpoints:
            raise ValueError(
                "tracking.registered_model needs tracking.log_checkpoints: a model version points at the logged "
                "checkpoint"
            )
        return self


# What runtime.device may say (torch's device strings of the devices the pipeline runs on; mps where torch has it).
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


class RuntimeConfig(Section):
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype. Trained models (SFT, reward, PPO policy and value) keep float32 weights and run "
        "under autocast in this dtype (on a CPU: bfloat16 only, fast where the CPU has AVX-512 BF16 or AMX); frozen "
        "ones (PPO reference and reward model, evaluation) are loaded in it. 'auto': bfloat16 on a CUDA device that "
        "supports it; on a CPU bfloat16 where the CPU multiplies bf16 natively, a measured check passes (bf16 "
        "autocast at least 1.2x float32's speed, its matmul error within 1e-2; measured once per machine and torch "
        "version, kept in ~/.cache/rlhf-pipeline/cpu_bf16.json) and the policy model is at least 128 wide (narrower "
        "ones run faster in float32), else float32; float32 elsewhere. 'float32' or 'bfloat16' forces one. float16 "
        "has no loss scaling.",
    )
    attn_implementation: str | None = Field(
        "sdpa",
        description="Attention kernel of every loaded model ('sdpa', 'eager', 'flash_attention_2', ...); 'sdpa' "
        "falls back to eager for models without it (Gemma-2); None lets transformers choose.",
    )
    compile_training: bool = Field(
        False,
        description="Run the PPO stage's training forwards and backwards (the policy's and the value model's "
        "backbone) under torch.compile (inductor): on the 2-core CPU's `cpu` bench shape the update about 10% shorter "
        "(no gain where a large vocabulary's LM head dominates), after a compile of 10 to 40 s per model in the first "
        "update; no-grad forwards (scoring, reference, evaluation) and generation stay eager (ppo.generation.decode "
        "'compiled' compiles decoding). Log-probs move by about 1e-6, so the first update's ratio is 1 and its KL 0 "
        "within that. Where the compile fails (no C++ compiler on a CPU, no triton on a GPU) the model trains eager, "
        "with a warning. Not with runtime.sharding 'fsdp'. docs/benchmark.md.",
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads; None keeps torch's default.")
    trust_remote_code: bool = Field(False, description="Allow model/tokenizer code from the hub. Off by default.")
    output_dir: str = Field("outputs", description="Root folder for checkpoints and prepared data.")
    device_slot: str | None = Field(
        None,
        description="Name of a Prefect global concurrency limit that each GPU stage holds one slot of while it runs "
        "(set by sweeps: one limit per device, so concurrent variants never share one); None: no slot.",
    )
    progress: bool = Field(True, description="Show progress bars in the terminal.")
    ppo_processes: int = Field(
        1,
        ge=1,
        description="Data-parallel processes of the PPO stage on this machine: > 1 runs it under torchrun (one per "
        "GPU; gloo processes on CPU). ppo.batch_size stays the global batch.",
    )
    sharding: Literal["none", "fsdp"] = Field(
        "none",
        description="How the PPO processes hold the models: 'none' replicates them (data parallel, gradients "
        "all-reduced); 'fsdp' shards the policy, value, reference and reward models over the processes with torch's "
        "FSDP2 (fully_shard per transformer block; gradients reduce-scattered), for models past one device's memory. "
        "'fsdp' needs several processes (runtime.ppo_processes > 1 or a torchrun launch), a separate value model and "
        "no LoRA, vLLM or periodic evaluation; its resume state is a torch.distributed.checkpoint folder. "
        "docs/scaling.md.",
    )
    memory_check: Literal["error", "warn", "off"] = Field(
        "error",
        description="Before any weight loads, estimate each stage's memory from the model's config.json and compare "
        "it with the device's free memory (RAM on CPU): 'error' stops with the estimate and the settings that would "
        "fit, 'warn' only warns, 'off' skips the check.",
    )
    memory_budget_gb: float | None = Field(
        None, gt=0, description="Memory budget of the check in GiB; None uses the device's free memory."
    )
    on_nonfinite: Literal["stop", "skip_update"] = Field(
        "stop",
        description="When a trainer's loss or gradient norm is NaN or infinite (SFT, reward model, PPO): 'stop' fails "
        "the stage with the stage, step and statistic, keeping the last saved state (a rerun resumes from it; Prefect "
        "does not retry); 'skip_update' skips that optimizer step and counts it in the metric */skipped_nonfinite.",
    )

    # The policy model's width (hidden size), which `dtype: auto` is checked at on a CPU (rlhf/models/cpu_bf16.py):
    # set from the rest of the config (`PipelineConfig`), not a key; None: unknown (a hub id)
    _model_width: int | None = PrivateAttr(None)

    @property
    def model_width(self) -> int | None:
        return self._model_width

    def with_model_width(self, width: int | None) -> RuntimeConfig:
        """This section, knowing its model's width (returned; changed in place)."""
        self._model_width = width
        return self

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not DEVICE.fullmatch(value.strip()):
            raise ValueError(f"runtime.device '{value}' is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return value.strip()

    @field_validator("memory_check", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @model_validator(mode="before")
    @classmethod
    def _bf16_is_dtype_now(cls, data: Any) -> Any:
        if isinstance(data, dict) and "bf16" in data:
            raise ValueError("runtime.bf16 was replaced by runtime.dtype ('auto', 'float32', 'bfloat16' or 'float16')")
        return data


# The row columns of a reasoning_gym source's rows (rlhf/data/reasoning_gym.py): the generator's answer, and the
# JSON text of the rest of its item (task, generator settings, question, metadata) that the task's score_answer reads
REASONING_GYM_COLUMNS = ("answer", "entry")

# Roles a source column can play (``data.columns`` maps a role to the source's column name).
DATA_COLUMN_ROLES = (
    "prompt",
    "chosen",
    "rejected",
    "score_chosen",
    "score_rejected",
    "margin",
    "responses",
    "scores",
    "ranks",
)


class DataConfig(Section):
    """Where the preference data comes from and how it is validated (see rlhf/data/ and docs/data.md)."""

    source: Literal["synthetic", "local", "hub", "reasoning_gym"] = Field(
        "synthetic",
        description="'synthetic': the built-in task; 'local': a file or save_to_disk folder (see `path`); "
        "'hub': a Hugging Face hub data set (see `name`); 'reasoning_gym': a task of the reasoning-gym package "
        "(see `task`; `pip install -e '.[reasoning]'`).",
    )
    path: str | None = Field(
        None,
        description="Local JSONL/JSON/Parquet/CSV file (the text ones also compressed: .jsonl.gz, .csv.bz2, .json.xz, "
        "...), a `save_to_disk` folder or a folder of data files (source 'local').",
    )
    eval_path: str | None = Field(None, description="Optional separate held-out file; else `eval_fraction` is split.")
    encoding: str = Field(
        "utf-8",
        description="Text encoding of the local JSONL/JSON/CSV files (`path`, `eval_path`, `prompts_path`), e.g. "
        "'latin-1', 'cp1252' or 'utf-16' for a file exported that way; a UTF-8 byte-order mark is skipped. Parquet "
        "and save_to_disk folders carry their own.",
    )
    name: str | None = Field(
        None, description="Hub data set id (source 'hub'), e.g. 'Anthropic/hh-rlhf'; any `load_dataset` path works."
    )
    config_name: str | None = Field(None, description="Hub data set configuration (`load_dataset`'s `name`).")
    data_dir: str | None = Field(
        None,
        description="Sub-folder of the hub data set (or of a local data folder) to read, e.g. 'helpful-base' of "
        "Anthropic/hh-rlhf (`load_dataset`'s `data_dir`).",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the data set.")
    train_split: str = Field("train", description="Split with the training pairs (hub and save_to_disk sources).")
    eval_split: str | None = Field(
        None, description="Split with held-out pairs (hub and save_to_disk); None splits off `eval_fraction`."
    )
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Held-out fraction when there is no eval source.")
    split_seed: int = Field(0, description="Seed of the deterministic train/eval split.")
    split_by_prompt: bool = Field(
        True,
        description="Hold out whole prompts, so no prompt has pairs in both train and eval (no leak into the "
        "held-out accuracy); false splits the pairs.",
    )
    format: Literal["auto", "explicit", "implicit", "conversational", "ranked"] = Field(
        "auto",
        description="Layout of the rows: 'auto' detects it; 'explicit' prompt/chosen/rejected strings; 'implicit' "
        "chosen/rejected transcripts sharing a prompt; 'conversational' message lists; 'ranked' responses + scores.",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Role -> source column, e.g. {prompt: question, chosen: response_j}; roles: "
        + ", ".join(DATA_COLUMN_ROLES)
        + ".",
    )
    assistant_marker: str = Field(
        "\n\nAssistant:", description="Implicit format: the prompt ends with the last one of these markers."
    )
    prompts_path: str | None = Field(
        None, description="Separate prompt-only file or folder for PPO rollouts; None uses the training prompts."
    )
    prompts_name: str | None = Field(
        None,
        description="Hub data set id of a prompt-only source for PPO rollouts (instead of `prompts_path`), e.g. "
        "'trl-lib/ultrafeedback-prompt'.",
    )
    prompts_config_name: str | None = Field(None, description="Configuration of the `prompts_name` data set.")
    prompts_revision: str | None = Field(None, description="Revision (branch, tag or commit) of `prompts_name`.")
    prompts_split: str = Field("train", description="Split of `prompts_name` (or of a `prompts_path` folder).")
    prompts_column: str = Field("prompt", description="Column of the prompt source that holds the prompts.")
    max_drop_fraction: float = Field(
        0.5, ge=0.0, le=1.0, description="Stop with an error when more than this fraction of rows is dropped."
    )
    max_length_tokens: int | None = Field(
        None, ge=1, description="Drop pairs whose prompt+response is longer (tokens of `tokenizer`); None: no limit."
    )
    max_length_chars: int | None = Field(
        None, ge=1, description="Drop pairs whose prompt+response is longer (characters); None: no limit."
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer (path or hub id) that renders message lists with its chat template and measures "
        "lengths in tokens; None defaults to `sft.model` (the policy's tokenizer) when that is set. Override it only "
        "to render for another model.",
    )
    tokenizer_revision: str | None = Field(
        None, description="Hub revision of `tokenizer`; None defaults to `sft.revision` when `tokenizer` is sft.model."
    )
    tokenizer_gguf_file: str | None = Field(
        None,
        description="The GGUF file inside the folder or hub repository `tokenizer` whose tokenizer is used; None "
        "defaults to `sft.gguf_file` when `tokenizer` is sft.model. A `tokenizer` ending in .gguf needs none.",
    )
    user_marker: str = Field(
        "\n\nHuman:",
        description="Implicit format with a chat template: transcripts are split into user turns at these markers "
        "(and assistant turns at `assistant_marker`) and rendered with the template.",
    )
    length_warn_fraction: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Warn (task log and manifest) when more than this share of the prompts or pairs is longer than "
        "a stage's length limit (ppo.max_prompt_tokens, reward.max_length, sft.max_length).",
    )
    gold_reward: str | None = Field(
        None,
        description="A gold reward of the data set's task, 'module:callable' with the signature of reward.function "
        "(prompts, responses, **row_columns) -> list[float] (e.g. rlhf.data.verifiers:ifeval_strict, IFEval's "
        "checkers): the evaluation and the PPO stage's periodic evaluation score responses with it (gold win rate, "
        "mean gold). None: the data has no gold reward (the synthetic task has its own).",
    )
    row_columns: list[str] = Field(
        default_factory=list,
        description="Columns of the source kept beside every pair and prompt, and passed by name to a reward "
        "function (reward.function, data.gold_reward) that takes them as keyword arguments, TRL's convention: a "
        "row's own truth, e.g. [instruction_id_list, kwargs] for IFEval's verifiers (rlhf.data.verifiers). Values may "
        "be nested (lists, dicts); they are part of the data's digest.",
    )
    num_proc: int | None = Field(None, ge=1, description="Processes for validation/tokenization; None: one.")
    batch_size: int = Field(1000, ge=1, description="Rows per validation/tokenization batch (bounds memory).")
    synthetic: SyntheticTaskConfig = Field(default_factory=SyntheticTaskConfig)
    task: ReasoningTaskConfig = Field(
        default_factory=ReasoningTaskConfig,
        description="The reasoning-gym task of data.source 'reasoning_gym' (its rows keep the row columns answer "
        "and entry, which rlhf.data.reasoning_gym's reward functions take).",
    )

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        import codecs

        try:
            codecs.lookup(value)
        except LookupError:
            raise ValueError(
                f"data.encoding '{value}' is not a text encoding Python knows (e.g. 'utf-8', 'latin-1')"
            ) from None
        return value

    @model_validator(mode="after")
    def _source_needs(self) -> DataConfig:
        if self.source == "local" and not self.path:
            raise ValueError(
                "data.path must name a JSONL/JSON/Parquet/CSV file or a save_to_disk folder when data.source is 'local'"
            )
        if self.prompts_path and self.prompts_name:
            raise ValueError("data.prompts_path and data.prompts_name both name a prompt source; set one of them")
        if self.source == "synthetic" and (self.prompts_path or self.prompts_name):
            raise ValueError(
                "data.prompts_path/prompts_name apply to 'local' and 'hub' sources: the synthetic task's gold reward "
                "is defined on its own prompts"
            )
        if self.source == "synthetic" and self.row_columns:
            raise ValueError("data.row_columns applies to 'local' and 'hub' sources: the synthetic task has no columns")
        if self.source == "synthetic" and self.gold_reward:
            raise ValueError("data.gold_reward applies to 'local' and 'hub' sources: the synthetic task has its own")
        if self.source == "reasoning_gym":
            self._check_reasoning_gym()
        if self.source == "hub" and not self.name:
            raise ValueError("data.name must name a hub data set (e.g. 'Anthropic/hh-rlhf') when data.source is 'hub'")
        unknown = sorted(set(self.columns) - set(DATA_COLUMN_ROLES))
        if unknown:
            raise ValueError(f"data.columns: unknown role '{unknown[0]}' (use {', '.join(DATA_COLUMN_ROLES)})")
        return self

    @model_validator(mode="before")
    @classmethod
    def _reasoning_gym_columns(cls, data: Any) -> Any:
        """A reasoning_gym source keeps its rows' truth (REASONING_GYM_COLUMNS) unless row_columns names them."""
        if isinstance(data, dict) and data.get("source") == "reasoning_gym" and not data.get("row_columns"):
            data = {**data, "row_columns": list(REASONING_GYM_COLUMNS)}
        return data

    def _check_reasoning_gym(self) -> None:
        given = [key for key in ("path", "eval_path", "name", "prompts_path", "prompts_name") if getattr(self, key)]
        if given:
            raise ValueError(
                f"data.{given[0]} names a file or data set, but data.source 'reasoning_gym' generates its "
                "items (data.task); remove it"
            )
        if sorted(self.row_columns) != sorted(REASONING_GYM_COLUMNS):
            raise ValueError(
                f"data.row_columns of data.source 'reasoning_gym' are {', '.join(REASONING_GYM_COLUMNS)} "
                f"(got {', '.join(self.row_columns)}); leave the key out"
            )
