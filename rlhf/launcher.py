"""The installed ``rlhf`` command: it finds the checkout and runs the command line kept there, ``flows/cli.py``.

Only the library is installed (pyproject.toml); the command line, the flows and the tasks stay folders of the
checkout. This launcher is the one piece of the ``rlhf`` package that knows the checkout's layout: it puts the
checkout's root first on ``sys.path`` and runs ``flows/cli.py`` by its file path, as the deployments of
prefect.yaml name their entry points, so that the library imports nothing from ``flows/``, ``tasks/`` or
``benchmarks/``. ``python -m flows.cli`` from the root of a checkout is the same command without the launcher.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

COMMAND_FILE = Path("flows") / "cli.py"


class CheckoutError(Exception):
    """The command line of the repository cannot be found (an installation without a checkout)."""


def checkout_root() -> Path:
    """The repository root holding ``flows/cli.py``: with an editable install (``pip install -e .``, what ``make``
    does) the folder above this package, otherwise the current folder, if it is a checkout."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (root / COMMAND_FILE).is_file() and (root / "tasks" / "stages.py").is_file():
            return root
    raise CheckoutError(
        "the rlhf command needs the repository's flows/ and tasks/ folders: run it from the root of a checkout "
        "installed with `pip install -e .` (or `make install`)"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        root = checkout_root()
    except CheckoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    command = runpy.run_path(str(root / COMMAND_FILE), run_name="rlhf_command")
    return command["main"](argv)


if __name__ == "__main__":
    sys.exit(main())
