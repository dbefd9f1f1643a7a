"""What the GPU check (benchmarks/gpu_check.py) reports besides its figures: the environment it ran in (the packages
it found, those carried in `.gpu-deps/`), and its table of rows, written as markdown and JSON."""

from __future__ import annotations

import importlib.util
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DEPS = ROOT / ".gpu-deps"
NEEDS = {
    "ppo": ("pydantic", "yaml", "safetensors"),
    "lora": ("pydantic", "yaml", "safetensors", "peft"),
    "pipeline": ("pydantic", "yaml", "prefect", "mlflow", "pandas", "pyarrow"),
    "real": ("pydantic", "yaml", "prefect", "mlflow", "pandas", "pyarrow", "gguf"),
}


def use_carried_deps() -> list[str]:
    """Put `.gpu-deps/common` and `.gpu-deps/cpXY` (this Python's compiled parts) before the installed packages: the
    versions `make gpu-deps` took together (pydantic with its core, a typing_extensions new enough for it)."""
    added: list[str] = []
    if not missing(("pydantic", "peft")):
        return added  # this environment has them (the development venv): left as it is
    for sub in (f"cp{sys.version_info.major}{sys.version_info.minor}", "common"):
        path = DEPS / sub
        if path.is_dir() and str(path) not in sys.path:
            sys.path.insert(1, str(path))  # after the checkout (sys.path[0])
            added.append(str(path))
    return added


def missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


@dataclass
class Row:
    """One line of the table: a check, its figures, the peer's figure where there is one."""

    check: str
    status: str = "ok"  # ok, skipped, failed
    figures: dict[str, Any] = field(default_factory=dict)
    peer: str = ""  # the TRL peer's figure, or why it is empty
    note: str = ""
    seconds: float = 0.0

    def cells(self) -> list[str]:
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in self.figures.items())
        return [self.check, self.status, shown or "-", self.peer or "-", self.note or "-"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_table(out: Path, env: dict[str, Any], rows: list[Row]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"environment": env, "rows": [vars(r) for r in rows]}, indent=2))
    header = ["check", "status", "this project", "TRL peer", "notes"]
    lines = [
        f"GPU check, {env['date']}: {env['device']} (torch {env['torch']}, CUDA {env['cuda']}, transformers "
        f"{env['transformers']}, Python {env['python']}); not installed: {', '.join(env['missing']) or 'none'}; "
        f"from .gpu-deps: {', '.join(Path(p).name for p in env['carried deps']) or 'nothing'}",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r.cells()) + " |" for r in rows]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def environment() -> dict[str, Any]:
    import transformers

    cuda = torch.cuda.is_available()
    carried = use_carried_deps()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "missing": sorted({m for mods in NEEDS.values() for m in missing(mods)} | set(missing(("trl",)))),
        "carried deps": carried,
    }
