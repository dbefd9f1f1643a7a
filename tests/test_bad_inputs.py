"""A battery of bad inputs, run as a new user runs the pipeline: ``python -m flows.pipeline --config conf/smoke.yaml
key=value ...``, each case a command of its own, on its own output folder and MLflow store. Four kinds: the config,
the data, the model folder (a checkpoint downloaded or copied slightly wrong) and the environment (a device, a server
or a folder that is not there). For every case: the exit code, no ``Traceback``, exactly one line starting
``error:`` that names the key, file, row or line (and says what to do), nothing trained (no stage output folder) and
no MLflow run left RUNNING.

Speed: a cold ``python -m flows.pipeline`` spends 10 s of CPU importing torch, transformers, Prefect and MLflow before
its first line runs; 60 cases would be ten minutes on two cores. So the cases run through a warm command: one process
imports ``flows.pipeline`` once, then forks a fresh process per case that runs the module as ``python -m`` does
(``runpy.run_module("flows.pipeline", run_name="__main__")`` with the case's ``sys.argv``, environment, working
folder, stdout and stderr, and the interpreter's exit handlers at its end), four at a time. Each case is still a
process of its own with its own exit code and output, and nothing one case does reaches another. Cases whose input
is read when a module is imported (``PREFECT_API_URL``: Prefect reads its settings then) run cold, as real
``python -m flows.pipeline`` processes, beside them; a few warm cases are also run cold, and both must give the same
exit code and sentence. The module takes about a minute and a half on two cores (measured: see the report of
issue 22).

Run by itself: ``pytest -n 0 tests/test_bad_inputs.py``; it is one xdist group (one worker builds the cases).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SMOKE = str(REPO / "conf" / "smoke.yaml")
JOBS = 4  # warm cases at once
COLD_JOBS = 2  # cold cases at once, beside them
CASE_LIMIT_S = 300  # a case still running after this is killed (and fails)

pytestmark = pytest.mark.xdist_group("bad_inputs")


# -- The warm command: one import, a fork per case -----------------------------------------------------------------


def fork_server(jobs: int = JOBS, limit_s: float = CASE_LIMIT_S) -> None:  # pragma: no cover (a subprocess)
    """Import the pipeline's command once, then run every case read from stdin (one JSON object a line: id, argv,
    env, cwd, stdout, stderr, serial) in a forked process of its own, `jobs` at a time, the `serial` ones one at a
    time (each starts a temporary Prefect server: two starting at once on one Prefect database race to register its
    blocks, and the loser logs a traceback); one JSON line per finished case on stdout (id, code, seconds)."""
    import flows.pipeline  # noqa: F401 (the warm part: every import a case would make)

    print(json.dumps({"ready": True}), flush=True)
    pending = [json.loads(line) for line in sys.stdin if line.strip()]
    running: dict[int, tuple[str, float]] = {}
    serial: set[int] = set()  # the running serial case, if any
    while pending or running:
        while len(running) < jobs:
            case = next((c for c in pending if not (c.get("serial") and serial)), None)
            if case is None:
                break
            pending.remove(case)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_case(case)
            running[pid] = (case["id"], time.monotonic())
            if case.get("serial"):
                serial.add(pid)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for child, (_, started) in running.items():
                if time.monotonic() - started > limit_s:
                    os.killpg(child, signal.SIGKILL)
            time.sleep(0.02)
            continue
        case_id, started = running.pop(pid)
        serial.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"id": case_id, "code": code, "seconds": time.monotonic() - started}), flush=True)


def _run_case(case: dict[str, Any]) -> None:  # pragma: no cover (a forked process)
    """In the forked process: what ``python -m flows.pipeline ARGV`` does after its imports, then exit."""
    import atexit
    import runpy
    import traceback

    code = 1
    try:
        os.setsid()  # a process group of its own: a stray child of a case is killed with it
        os.environ.update(case["env"])
        os.chdir(case["cwd"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, case["stdout"]), (2, case["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        sys.argv = [str(REPO / "flows" / "pipeline.py"), *case["argv"]]
        try:
            runpy.run_module("flows.pipeline", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
            if not isinstance(done.code, int | None):
                print(done.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 (what the interpreter would print)
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # the interpreter's exit: Prefect's temporary server stops, logs flush
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# -- The cases -----------------------------------------------------------------------------------------------------


@dataclass
class Assets:
    """What the cases are made from: a good tiny checkpoint (tests/model_zoo.py) and good preference rows."""

    model: Path
    cuda: bool

    @staticmethod
    def rows(n: int = 40) -> list[dict[str, Any]]:
        return [
            {
                "prompt": f"Review of film {i}:",
                "chosen": f" the plot was superb {i}.",
                "rejected": f" the plot was dull {i}.",
            }
            for i in range(n)
        ]


@dataclass
class Case:
    kind: str  # config, data, model, environment
    name: str
    make: Callable[[Path, Assets], list[str]]  # (case folder, assets) -> the overrides or the whole argv
    says: tuple[str, ...]  # what the `error:` line must contain (the key, file, row or line, and the what)
    code: int = 2
    env: dict[str, str] = field(default_factory=dict)
    cold: bool = False  # run as a real `python -m flows.pipeline` (input read at import)
    flow: bool = False  # found inside the flow: its temporary Prefect server starts, one such case at a time
    whole_argv: bool = False  # `make` gives the whole argv (a --config of its own), not overrides of smoke.yaml
    skip: Callable[[Assets], str | None] = lambda assets: None

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.name}"


def _lines(path: Path, lines: list[str], encoding: str = "utf-8", gz: bool = False) -> Path:
    data = ("\n".join(lines) + "\n").encode(encoding)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _jsonl(path: Path, rows: list[dict[str, Any]], gz: bool = False) -> Path:
    return _lines(path, [json.dumps(r) for r in rows], gz=gz)


def _local(path: Path, *more: str) -> list[str]:
    return ["data.source=local", f"data.path={path}", *more]


def _broken_line(rows: list[dict[str, Any]], at: int) -> list[str]:
    lines = [json.dumps(r) for r in rows]
    lines[at] = lines[at][:-7]  # a line cut short in the middle of its last string
    return lines


def _copy_model(folder: Path, assets: Assets) -> Path:
    return Path(shutil.copytree(assets.model, folder / "model"))


def _edit_json(file: Path, **changes: Any) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def _model_case(change: Callable[[Path], None], *more: str) -> Callable[[Path, Assets], list[str]]:
    def make(folder: Path, assets: Assets) -> list[str]:
        model = _copy_model(folder, assets)
        change(model)
        return [f"sft.model={model}", *more]

    return make


def _truncate(file: Path, keep: float = 0.5) -> None:
    file.write_bytes(file.read_bytes()[: int(file.stat().st_size * keep)])


def _no_tokenizer(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (model / name).unlink(missing_ok=True)


def _sharded_without_second_shard(model: Path) -> None:
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    weight_map = {"transformer.wte.weight": "model-00001-of-00002.safetensors"}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _torch_bin_cut_short(model: Path) -> None:
    import torch

    (model / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(4096)}, model / "pytorch_model.bin")
    _truncate(model / "pytorch_model.bin")


def _adapter_only(model: Path) -> None:
    for file in model.iterdir():
        file.unlink()
    (model / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "gpt2"}))
    (model / "adapter_model.safetensors").write_bytes(b"\0" * 64)


LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a21\nsize 52428800\n"
HTML_PAGE = "<!DOCTYPE html>\n<html><head><title>429 Too Many Requests</title></head></html>\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _a_file(folder: Path) -> Path:
    file = folder / "not-a-folder"
    file.write_text("x")
    return file


def _no_cuda(assets: Assets) -> str | None:
    return "this machine has CUDA" if assets.cuda else None


def _ranked_nan(folder: Path, assets: Assets) -> list[str]:
    rows = [
        {"prompt": f"Review of film {i}:", "responses": [f" superb {i}.", f" dull {i}."], "scores": [float("nan"), 1.0]}
        for i in range(40)
    ]
    return _local(_jsonl(folder / "ranked.jsonl", rows))


def _identical(folder: Path, assets: Assets) -> list[str]:
    text = "\n\nHuman: Review of The Silent River:\n\nAssistant: the plot was superb."
    return _local(_jsonl(folder / "pairs.jsonl", [{"chosen": text, "rejected": text}] * 40))


CASES: list[Case] = [
    # -- config: numbers, keys, types, files (the issue's `ppo.lr=inf` first)
    Case("config", "lr-inf", lambda f, a: ["ppo.lr=inf"], ("ppo.lr is inf", "finite")),
    Case("config", "lr-yaml-inf", lambda f, a: ["sft.lr=.inf"], ("sft.lr is inf", "finite")),
    Case("config", "cliprange-nan", lambda f, a: ["ppo.cliprange=nan"], ("ppo.cliprange is nan", "finite")),
    Case("config", "coef-minus-inf", lambda f, a: ["reward.center_coef=-.inf"], ("reward.center_coef is -inf",)),
    Case("config", "kl-coef-overflow", lambda f, a: ["ppo.kl_coef=1e999"], ("ppo.kl_coef is 1e999", "finite")),
    Case("config", "temperature-nan", lambda f, a: ["eval.temperature=.nan"], ("eval.temperature is nan",)),
    Case("config", "lr-zero", lambda f, a: ["ppo.lr=0"], ("ppo.lr", "greater than 0")),
    Case("config", "batches-divide", lambda f, a: ["ppo.num_mini_batches=3"], ("ppo.num_mini_batches (3)",)),
    Case("config", "unknown-key", lambda f, a: ["ppo.learning_rate=1e-5"], ("unknown key 'ppo.learning_rate'",)),
    Case("config", "ensemble-size-zero", lambda f, a: ["reward.ensemble_size=0"], ("reward.ensemble_size",)),
    Case(
        "config",
        "ensemble-of-a-function",
        lambda f, a: [
            "reward.source=function",
            "reward.function=rlhf.data.synthetic:gold_reward",
            "reward.ensemble_size=2",
        ],
        ("reward.ensemble_size 2 needs reward models to train",),
    ),
    Case(
        "config", "ensemble-objective", lambda f, a: ["reward.ensemble_objective=median"], ("'mean', 'uwo' or 'wco'",)
    ),
    Case(
        "config",
        "stop-without-evaluations",
        lambda f, a: ["ppo.on_overoptimisation=keep_best", "ppo.eval_every=0"],
        ("ppo.on_overoptimisation 'keep_best' picks among the periodic evaluations",),
    ),
    Case(
        "config",
        "dynamic-sampling-without-groups",
        lambda f, a: ["ppo.dynamic_sampling_rounds=2"],
        ("ppo.dynamic_sampling_rounds (2)", "no groups"),
    ),
    Case(
        "config",
        "sequence-ratio-with-gae",
        lambda f, a: ["ppo.importance_sampling_level=sequence"],
        ("ppo.importance_sampling_level 'sequence'", "critic-free"),
    ),
    Case(
        "config",
        "cliprange-high-below-cliprange",
        lambda f, a: ["ppo.cliprange=0.2", "ppo.cliprange_high=0.1"],
        ("ppo.cliprange_high (0.1) is below ppo.cliprange (0.2)",),
    ),
    Case("config", "wrong-type", lambda f, a: ["ppo.batch_size=sixteen"], ("ppo.batch_size", "sixteen")),
    Case("config", "device-name", lambda f, a: ["runtime.device=gpu"], ("runtime.device 'gpu'", "'cuda'")),
    Case("config", "dtype-name", lambda f, a: ["runtime.dtype=fp16"], ("runtime.dtype", "fp16")),
    Case("config", "bf16-renamed", lambda f, a: ["runtime.bf16=true"], ("runtime.bf16 was replaced by runtime.dtype",)),
    Case("config", "threads-zero", lambda f, a: ["runtime.threads=0"], ("runtime.threads",)),
    Case("config", "override-without-value", lambda f, a: ["ppo.lr"], ("override 'ppo.lr'", "key.sub=value")),
    Case("config", "local-without-path", lambda f, a: ["data.source=local"], ("data.path must name",)),
    Case("config", "finetune-without-model", lambda f, a: ["sft.finetune=true"], ("sft.finetune needs sft.model",)),
    Case(
        "config",
        "lengths-past-positions",
        lambda f, a: ["reward.max_length=512"],
        ("reward.max_length (512)", "128 positions"),
    ),
    Case("config", "encoding-name", lambda f, a: ["data.encoding=latin-42"], ("data.encoding 'latin-42'",)),
    Case(
        "config",
        "config-file-missing",
        lambda f, a: ["--config", str(f / "smoke.yml")],
        ("config file", "smoke.yml does not exist"),
        whole_argv=True,
    ),
    Case(
        "config",
        "config-not-yaml",
        lambda f, a: ["--config", str(_lines(f / "c.yaml", ["ppo:", "  lr: [1e-5", "seed: 0"]))],
        ("c.yaml is not valid YAML",),
        whole_argv=True,
    ),
    # -- data: the bytes, lines and numbers of a downloaded or exported file
    Case(
        "data",
        "malformed-line",
        lambda f, a: _local(_lines(f / "pairs.jsonl", _broken_line(a.rows(), 17))),
        ("data.path: line 18 of", "pairs.jsonl is not valid JSON"),
    ),
    Case(
        "data",
        "malformed-line-gz",
        lambda f, a: _local(_lines(f / "pairs.jsonl.gz", _broken_line(a.rows(), 29), gz=True)),
        ("line 30 of", "pairs.jsonl.gz is not valid JSON"),
    ),
    Case(
        "data",
        "latin-1-jsonl",
        lambda f, a: _local(
            _lines(
                f / "pairs.jsonl",
                [json.dumps(dict(r, chosen=" café"), ensure_ascii=False) for r in a.rows()],
                "latin-1",
            )
        ),
        ("pairs.jsonl is not UTF-8 text", "byte 0xe9 at byte offset", "(line 1)", "data.encoding"),
    ),
    Case(
        "data",
        "latin-1-csv",
        lambda f, a: _local(
            _lines(
                f / "pairs.csv",
                ["prompt,chosen,rejected"] + [f"Critique {i},très bien {i},mauvais {i}" for i in range(40)],
                "latin-1",
            )
        ),
        ("pairs.csv is not UTF-8 text", "(line 2)", "re-encode it as UTF-8"),
    ),
    Case(
        "data",
        "utf-16-export",
        lambda f, a: _local(_lines(f / "pairs.jsonl", [json.dumps(r) for r in a.rows()], "utf-16")),
        ("pairs.jsonl is UTF-16 text", "data.encoding: utf-16"),
    ),
    Case(
        "data",
        "download-cut-short-gz",
        lambda f, a: _local(_cut_gz(f / "pairs.jsonl.gz", a.rows(4000))),
        ("pairs.jsonl.gz could not be read to its end", "download it again"),
    ),
    Case(
        "data",
        "html-error-page",
        lambda f, a: _local(_lines(f / "pairs.jsonl", HTML_PAGE.splitlines())),
        ("line 1 of", "pairs.jsonl is not valid JSON"),
    ),
    Case(
        "data",
        "json-array-as-jsonl",
        lambda f, a: _local(_lines(f / "pairs.jsonl", json.dumps(a.rows(), indent=1).splitlines())),
        ("pairs.jsonl starts with '['", "name it .json"),
    ),
    Case(
        "data",
        "csv-ragged-line",
        lambda f, a: _local(
            _lines(f / "pairs.csv", ["prompt,chosen,rejected"] + [f"p{i},c{i},r{i}" for i in range(9)] + ["p,c,r,x"])
        ),
        ("pairs.csv is not valid CSV", "line 11"),
    ),
    Case(
        "data",
        "parquet-cut-short",
        lambda f, a: _local(_cut_parquet(f / "pairs.parquet", a.rows())),
        ("pairs.parquet is not a readable Parquet file", "download it again"),
    ),
    Case(
        "data",
        "nan-margins",
        lambda f, a: _local(
            _jsonl(f / "pairs.jsonl", [dict(r, margin=float("nan") if i % 4 else 1.0) for i, r in enumerate(a.rows())])
        ),
        ("data.path: 30 of 40 rows", "NaN or infinite", "line 2 (column 'margin')", "data.max_drop_fraction"),
    ),
    Case(
        "data",
        "infinite-scores",
        lambda f, a: _local(
            _jsonl(f / "pairs.jsonl", [dict(r, score_chosen=float("inf"), score_rejected=0.0) for r in a.rows()])
        ),
        ("40 of 40 rows", "line 1 (column 'score_chosen')"),
    ),
    Case(
        "data",
        "csv-infinite-margins",
        lambda f, a: _local(
            _lines(f / "pairs.csv", ["prompt,chosen,rejected,margin"] + [f"p{i},c{i},r{i},inf" for i in range(20)])
        ),
        ("20 of 20 rows", "pairs.csv line 2 (column 'margin')"),
    ),
    Case(
        "data",
        "git-lfs-pointer",
        lambda f, a: _local(_lines(f / "pairs.jsonl", LFS_POINTER.splitlines())),
        ("pairs.jsonl is a Git LFS pointer", "git lfs pull"),
    ),
    Case("data", "empty-file", lambda f, a: _local(_lines(f / "pairs.jsonl", [])), ("pairs.jsonl has no rows",)),
    Case(
        "data",
        "no-preference-columns",
        lambda f, a: _local(_jsonl(f / "red.jsonl", [{"transcript": "hi", "rating": i % 4} for i in range(20)])),
        ("red.jsonl has no recognisable preference format",),
    ),
    Case(
        "data",
        "mapped-column-missing",
        lambda f, a: _local(_jsonl(f / "pairs.jsonl", a.rows()), "data.columns={chosen: response_j}"),
        ("data.columns.chosen: column 'response_j' is not in",),
    ),
    Case("data", "path-missing", lambda f, a: _local(f / "pairs.jsonl"), ("data.path: file", "does not exist")),
    Case(
        "data",
        "unsupported-extension",
        lambda f, a: _local(_jsonl(f / "pairs.txt", a.rows())),
        ("data.path:", "unsupported extension '.txt'"),
    ),
    Case(
        "data",
        "eval-file-malformed-line",
        lambda f, a: _local(
            _jsonl(f / "train.jsonl", a.rows()),
            f"data.eval_path={_lines(f / 'eval.jsonl', _broken_line(a.rows(8), 5))}",
        ),
        ("data.eval_path: line 6 of", "eval.jsonl is not valid JSON"),
    ),
    Case(
        "data",
        "prompts-file-latin-1",
        lambda f, a: _local(
            _jsonl(f / "train.jsonl", a.rows()),
            f"data.prompts_path={_latin_1_prompts(f / 'prompts.jsonl')}",
        ),
        ("data.prompts_path:", "prompts.jsonl is not UTF-8 text"),
    ),
    # found by the data stage inside the flow (the full validation): the same one sentence
    Case("data", "identical-pairs", _identical, ("pairs.jsonl", "identical chosen and rejected"), flow=True),
    Case("data", "ranked-nan-scores", _ranked_nan, ("ranked.jsonl", "not_finite", "NaN or infinite"), flow=True),
    # -- model folder: a checkpoint downloaded or copied slightly wrong (the four rows first)
    Case("model", "no-tokenizer", _model_case(_no_tokenizer), ("sft.model:", "has no tokenizer", "save_pretrained")),
    Case(
        "model",
        "safetensors-cut-short",
        _model_case(lambda m: _truncate(m / "model.safetensors")),
        ("sft.model:", "model.safetensors is cut short", "download it again"),
    ),
    Case(
        "model",
        "tokenizer-cannot-pad",
        _model_case(lambda m: _edit_json(m / "tokenizer_config.json", eos_token=None, pad_token=None, bos_token=None)),
        ("sft.model:", "neither a pad token nor an EOS token", '"pad_token"'),
    ),
    Case(
        "model",
        "custom-code",
        _model_case(
            lambda m: _edit_json(
                m / "config.json",
                model_type="tiny_custom_lm",
                auto_map={
                    "AutoConfig": "configuration_tiny.TinyConfig",
                    "AutoModelForCausalLM": "modeling_tiny.TinyLM",
                },
            )
        ),
        ("sft.model:", "runs code of its own", "runtime.trust_remote_code: true"),
    ),
    Case(
        "model",
        "custom-code-file-missing",
        _model_case(
            lambda m: _edit_json(
                m / "config.json", model_type="tiny_custom_lm", auto_map={"AutoConfig": "configuration_tiny.TinyConfig"}
            ),
            "runtime.trust_remote_code=true",
        ),
        ("sft.model:", "configuration_tiny.py, which is not in the folder"),
    ),
    Case(
        "model",
        "unknown-model-type",
        _model_case(lambda m: _edit_json(m / "config.json", model_type="gpt5")),
        ("sft.model:", "'gpt5' model", "upgrade transformers"),
    ),
    Case(
        "model",
        "no-config",
        _model_case(lambda m: (m / "config.json").unlink()),
        ("sft.model: folder", "has no config.json"),
    ),
    Case(
        "model",
        "config-cut-short",
        _model_case(lambda m: _truncate(m / "config.json")),
        ("sft.model:", "config.json is not valid JSON"),
    ),
    Case(
        "model",
        "no-weights",
        _model_case(lambda m: (m / "model.safetensors").unlink()),
        ("sft.model:", "has no weights"),
    ),
    Case(
        "model",
        "shard-missing",
        _model_case(_sharded_without_second_shard),
        ("model-00002-of-00002.safetensors", "model.safetensors.index.json names, is missing"),
    ),
    Case(
        "model",
        "weights-lfs-pointer",
        _model_case(lambda m: (m / "model.safetensors").write_text(LFS_POINTER)),
        ("model.safetensors is a Git LFS pointer", "git lfs pull"),
    ),
    Case(
        "model",
        "weights-html-page",
        _model_case(lambda m: (m / "model.safetensors").write_text(HTML_PAGE)),
        ("model.safetensors is cut short or is not a safetensors file",),
    ),
    Case(
        "model",
        "pytorch-bin-cut-short",
        _model_case(_torch_bin_cut_short),
        ("pytorch_model.bin is cut short",),
    ),
    Case(
        "model",
        "tokenizer-config-broken",
        _model_case(lambda m: (m / "tokenizer_config.json").write_text("{")),
        ("sft.model: the tokenizer of", "cannot be loaded"),
    ),
    Case(
        "model",
        "another-models-tokenizer",
        _model_case(lambda m: _edit_json(m / "config.json", vocab_size=100)),
        ("sft.model: the tokenizer of", "500 tokens", "100 (config.json vocab_size)"),
    ),
    Case("model", "lora-adapter", _model_case(_adapter_only), ("sft.model:", "LoRA (peft) adapter", "merge")),
    Case(
        "model",
        "weights-file-not-folder",
        lambda f, a: [f"sft.model={_copy_model(f, a) / 'model.safetensors'}"],
        ("sft.model:", "model.safetensors is a file", "name the folder"),
    ),
    Case(
        "model",
        "fewer-positions",
        _model_case(lambda m: _edit_json(m / "config.json", n_positions=16)),
        ("exceed the 16 positions of the SFT model", "config.json of"),
    ),
    # -- environment: devices, servers, folders, switches
    Case(
        "environment",
        "cuda-missing",
        lambda f, a: ["runtime.device=cuda"],
        ("runtime.device is 'cuda'",),
        skip=_no_cuda,
    ),
    Case("environment", "cuda-index", lambda f, a: ["runtime.device=cuda:99"], ("runtime.device is 'cuda:99'",)),
    Case("environment", "mps-missing", lambda f, a: ["runtime.device=mps"], ("runtime.device is 'mps'",)),
    Case(
        "environment",
        "tracking-server-down",
        lambda f, a: [f"tracking.uri=http://127.0.0.1:{_free_port()}"],
        ("tracking.uri: no MLflow tracking server answers",),
    ),
    Case(  # MLflow's convention: MLFLOW_TRACKING_URI is tracking.uri where the config names none
        "environment",
        "tracking-server-down-from-the-environment",
        lambda f, a: [],
        ("tracking.uri: no MLflow tracking server answers at http://127.0.0.1:", "came from $MLFLOW_TRACKING_URI"),
        env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:{port}"},
    ),
    Case(
        "environment",
        "tracking-store-in-a-file",
        lambda f, a: [f"tracking.uri=sqlite:///{_a_file(f)}/mlflow.db"],
        ("tracking.uri: cannot write the SQLite store",),
    ),
    Case(
        "environment",
        "output-dir-in-a-file",
        lambda f, a: [f"runtime.output_dir={_a_file(f)}/out"],
        ("runtime.output_dir:", "not-a-folder, which is a file"),
    ),
    Case(
        "environment",
        "output-dir-on-proc",  # writable by root's permissions, yet no file can be made there
        lambda f, a: ["runtime.output_dir=/proc/rlhf-out"],
        ("runtime.output_dir: /proc/rlhf-out cannot be written",),
    ),
    Case(
        "environment",
        "hub-offline",
        lambda f, a: ["sft.model=EleutherAI/pythia-14m"],
        ("sft.model: 'EleutherAI/pythia-14m' is not a local folder", "HF_HUB_OFFLINE=1"),
        env={"HF_HUB_OFFLINE": "1"},
    ),
    Case(
        "environment",
        "prefect-server-down",
        lambda f, a: [],
        ("PREFECT_API_URL is http://127.0.0.1:", "no Prefect server answers there"),
        env={"PREFECT_API_URL": "http://127.0.0.1:{port}/api"},
        cold=True,
    ),
    Case(
        "environment",
        "memory-budget",
        lambda f, a: ["runtime.memory_budget_gb=0.0001"],
        ("runtime.memory_check: the", "needs about", "runtime.memory_check=warn"),
    ),
]
# Warm cases also run cold: the warm command must give the same exit code and sentence as a real process.
ALSO_COLD = ("config-lr-inf", "data-malformed-line")


def _latin_1_prompts(path: Path) -> Path:
    return _lines(path, [json.dumps({"prompt": f"Résumé {i}:"}, ensure_ascii=False) for i in range(8)], "latin-1")


def _cut_gz(path: Path, rows: list[dict[str, Any]]) -> Path:
    _jsonl(path, rows, gz=True)
    _truncate(path, 0.6)
    return path


def _cut_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)
    _truncate(path, 0.7)
    return path


# -- Running them --------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int | None
    stdout: str
    stderr: str
    folder: Path
    seconds: float
    cold: bool

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _argv(case: Case, folder: Path, assets: Assets) -> list[str]:
    made = case.make(folder, assets)
    if case.whole_argv:
        return made
    store = [f"tracking.uri=sqlite:///{folder}/mlflow.db", f"tracking.artifact_location={folder}/artifacts"]
    if not any(m.startswith("tracking.uri=") for m in made) and "MLFLOW_TRACKING_URI" not in case.env:
        made = [*store, *made]
    return ["--config", SMOKE, f"runtime.output_dir={folder}/out", *made]


def _env(case: Case, root: Path, folder: Path, cold: bool) -> dict[str, str]:
    """A cold case gets a Prefect home of its own; the warm ones share the warm command's (read at its import)."""
    from conftest import seed_prefect_home  # here: the fork server imports this module, and conftest sets a home

    env = {key: value.format(port=_free_port()) for key, value in case.env.items()}
    home = folder / "prefect" if cold else root / "prefect"
    return {
        "PREFECT_HOME": seed_prefect_home(home) if cold else str(home),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        **env,
    }


def run_cases(cases: list[tuple[Case, bool]], root: Path, assets: Assets) -> dict[tuple[str, bool], Outcome]:
    """Every (case, cold) in its own process: the warm ones through `fork_server`, `JOBS` at a time, the cold ones
    as `python -m flows.pipeline`, `COLD_JOBS` at a time, both at once."""
    requests, cold = [], []
    for case, is_cold in cases:
        folder = root / (case.id + ("-cold" if is_cold else ""))
        folder.mkdir(parents=True)
        request = {
            "id": case.id,
            "argv": _argv(case, folder, assets),
            "env": _env(case, root, folder, is_cold),
            "cwd": str(REPO),
            "stdout": str(folder / "stdout.txt"),
            "stderr": str(folder / "stderr.txt"),
            "serial": case.flow,
        }
        (cold if is_cold else requests).append((case, request, folder))
    from conftest import seed_prefect_home

    requests.sort(key=lambda item: not item[0].flow)  # the long ones (a flow each) first
    base_env = {
        **os.environ,
        "PREFECT_HOME": seed_prefect_home(root / "prefect"),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]; "
            "import test_bad_inputs; test_bad_inputs.fork_server()",
        ],
        cwd=REPO,
        env=base_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    outcomes: dict[tuple[str, bool], Outcome] = {}
    try:
        waiting: dict[str, Path] = {}
        started_cold: list[tuple[Case, subprocess.Popen, Path, float]] = []
        line = server.stdout.readline()
        assert json.loads(line or "{}").get("ready"), "the warm command did not start"
        for case, request, folder in requests:
            server.stdin.write(json.dumps(request) + "\n")
            waiting[case.id] = folder
        server.stdin.close()
        pending_cold = list(cold)
        deadline = time.monotonic() + CASE_LIMIT_S * (1 + len(cases) // JOBS)
        import selectors

        selector = selectors.DefaultSelector()
        selector.register(server.stdout, selectors.EVENT_READ)
        while (waiting or pending_cold or started_cold) and time.monotonic() < deadline:
            while pending_cold and len(started_cold) < COLD_JOBS:
                case, request, folder = pending_cold.pop(0)
                with open(request["stdout"], "w") as out, open(request["stderr"], "w") as err:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "flows.pipeline", *request["argv"]],
                        cwd=REPO,
                        env={**base_env, **request["env"]},
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                started_cold.append((case, proc, folder, time.monotonic()))
            for case, proc, folder, started in list(started_cold):
                if proc.poll() is not None or time.monotonic() - started > CASE_LIMIT_S:
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                    started_cold.remove((case, proc, folder, started))
                    outcomes[(case.id, True)] = _outcome(proc.returncode, folder, time.monotonic() - started, True)
            if waiting and selector.select(timeout=0.2):
                line = server.stdout.readline()
                if not line:
                    break
                done = json.loads(line)
                folder = waiting.pop(done["id"])
                outcomes[(done["id"], False)] = _outcome(done["code"], folder, done["seconds"], False)
            elif not waiting:
                time.sleep(0.2)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    return outcomes


def _outcome(code: int | None, folder: Path, seconds: float, cold: bool) -> Outcome:
    read = lambda name: (folder / name).read_text(errors="replace") if (folder / name).is_file() else ""  # noqa: E731
    return Outcome(code, read("stdout.txt"), read("stderr.txt"), folder, seconds, cold)


@pytest.fixture(scope="module")
def assets(family_checkpoint) -> Assets:
    import torch

    return Assets(model=family_checkpoint("gpt2"), cuda=torch.cuda.is_available())


@pytest.fixture(scope="module")
def outcomes(assets, tmp_path_factory) -> dict[tuple[str, bool], Outcome]:
    root = tmp_path_factory.mktemp("bad-inputs")
    runs = [(case, case.cold) for case in CASES if case.skip(assets) is None]
    runs += [(case, True) for case in CASES if case.id in ALSO_COLD]
    started = time.monotonic()
    found = run_cases(runs, root, assets)
    slowest = sorted(found.items(), key=lambda item: -item[1].seconds)[:5]
    print(
        f"\nbad-input battery: {len(found)} processes in {time.monotonic() - started:.0f} s; slowest: "
        + ", ".join(f"{case_id}{' (cold)' if cold else ''} {o.seconds:.0f} s" for (case_id, cold), o in slowest)
    )
    return found


def _stage_folders(out: Path) -> list[Path]:
    """The stage output folders under a run's output folder (a stage's hidden scratch folders aside)."""
    return [p for p in out.glob("*/*") if p.is_dir() and not p.name.startswith(".")] if out.is_dir() else []


def _running_runs(folder: Path) -> list[str]:
    store = folder / "mlflow.db"
    if not store.is_file():
        return []
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    return [
        run.info.run_name or run.info.run_id
        for experiment in client.search_experiments()
        for run in client.search_runs([experiment.experiment_id], max_results=1000)
        if run.info.status == "RUNNING"
    ]


def assert_one_sentence(case: Case, outcome: Outcome) -> None:
    where = f"{case.id}{' (cold)' if outcome.cold else ''}:\n{outcome.output[-6000:]}"
    assert outcome.code == case.code, where
    assert "Traceback" not in outcome.output, where
    errors = [line for line in outcome.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, where
    for words in case.says:
        assert words in errors[0], f"{words!r} not in {errors[0]!r}"
    assert _stage_folders(outcome.folder / "out") == [], where  # nothing trained, nothing prepared
    assert _running_runs(outcome.folder) == [], where


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_one_sentence_and_nothing_runs(case: Case, assets, outcomes):
    reason = case.skip(assets)
    if reason:
        pytest.skip(reason)
    assert_one_sentence(case, outcomes[(case.id, case.cold)])


@pytest.mark.parametrize("case_id", ALSO_COLD)
def test_the_warm_command_says_what_a_cold_process_says(case_id: str, outcomes):
    warm, cold = outcomes[(case_id, False)], outcomes[(case_id, True)]
    case = next(c for c in CASES if c.id == case_id)
    assert_one_sentence(case, cold)

    def sentence(outcome: Outcome) -> str:
        line = next(line for line in outcome.stderr.splitlines() if line.startswith("error:"))
        return line.replace(str(outcome.folder), "<case>")

    assert (warm.code, sentence(warm)) == (cold.code, sentence(cold))


def test_the_battery_covers_four_kinds():
    kinds = {kind: sum(case.kind == kind for case in CASES) for kind in ("config", "data", "model", "environment")}
    assert sum(kinds.values()) == len(CASES) >= 40 and min(kinds.values()) >= 8, kinds
    assert len({case.id for case in CASES}) == len(CASES)
