"""Every benchmark of the project, in one place (docs/benchmark.md).

- `shapes`: the fixed PPO shapes (also loaded by the peers, `trl_peer.py`, in their own venvs);
- `ppo_bench`: the timed PPO updates (the trainer's own update steps) and the FLOP count of one untimed update;
- `limit`: FLOP counting, matmul peaks, memory traffic of generation, the report's table;
- `cli`: ``make bench`` / ``rlhf bench`` (``python -m benchmarks``);
- `trl_peer`: TRL's trainers on the same shapes (``make bench PEER=1``), run in the peers' own venvs;
- `overhead_bench`, `overhead_clock`, `overhead_report`: the pipeline through Prefect and MLflow against the library
  alone (``make bench-overhead``);
- `sweep_bench`: a sweep sequential against concurrent (``make bench-sweep``);
- `prepare_bench`: the data preparation stage on N synthetic pairs (``python -m benchmarks.prepare_bench``).

Like ``flows/`` and ``tasks/`` this folder is part of the checkout, not of the installed library.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from .cli import main as cli_main

    return cli_main(argv)
