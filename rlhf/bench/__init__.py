"""PPO throughput benchmark on the fixed shapes of docs/benchmark.md (``make bench``, ``rlhf bench``).

- `shapes`: the shapes (also loaded by the peers, benchmarks/trl_peer.py, in their own venvs);
- `run`: the timed updates (the trainer's own update steps) and the FLOP count of one untimed update;
- `limit`: FLOP counting, matmul peaks, memory traffic of generation, the report's table;
- `cli`: the command.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from .cli import main as cli_main

    return cli_main(argv)
