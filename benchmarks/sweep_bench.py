"""Wall time of a 4-variant sweep of the smoke config: sequential (max_concurrency 1) against max_concurrency 2.

    make bench-sweep                      # or: .venv/bin/python benchmarks/sweep_bench.py [--concurrency 2]

Each sweep starts from an empty output folder and MLflow store, so both build the shared stages (data, SFT, reward
model) once and then run the four PPO + evaluation variants. On a CPU-only machine the concurrent variants share
the cores (each gets cores / concurrency threads); on a machine with GPUs each variant gets its own GPU. The last
line is `speedup: X` (sequential wall time / concurrent wall time).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flows.sweep import rlhf_sweep  # noqa: E402 (after the checkout is on sys.path)
from rlhf.config import load_config  # noqa: E402
from rlhf.sweeps.space import parse_space  # noqa: E402

SPACE = {"name": "bench", "parameters": {"ppo.kl_coef": [0.02, 0.05], "ppo.lr": [1.0e-4, 3.0e-4]}}


def timed_sweep(folder: Path, concurrency: int) -> tuple[float, list[str]]:
    config = load_config(
        REPO / "conf" / "smoke.yaml",
        [
            f"tracking.uri=sqlite:///{folder}/mlflow.db",
            f"tracking.artifact_location={folder}/artifacts",
            f"runtime.output_dir={folder}/outputs",
            "tracking.log_checkpoints=false",
        ],
    )
    space = parse_space({**SPACE, "max_concurrency": concurrency})
    start = time.perf_counter()
    result = rlhf_sweep(config, space)
    return time.perf_counter() - start, [row["status"] for row in result["ranking"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=2, help="max_concurrency of the concurrent sweep")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp:
        times = {}
        for concurrency in (1, args.concurrency):
            wall, statuses = timed_sweep(Path(tmp) / f"c{concurrency}", concurrency)
            if set(statuses) != {"completed"}:
                print(f"error: a variant did not complete ({statuses})", file=sys.stderr)
                return 1
            times[concurrency] = wall
    print()
    print(f"4-variant sweep of conf/smoke.yaml on {os.cpu_count()} CPU cores")
    print(f"sequential (max_concurrency=1):         {times[1]:.1f} s")
    print(f"concurrent (max_concurrency={args.concurrency}):         {times[args.concurrency]:.1f} s")
    print(f"speedup: {times[1] / times[args.concurrency]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
