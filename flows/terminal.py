"""What a user sees on the terminal when a flow stops on their input: one sentence and exit code 2.

A ConfigError or DataError raised inside a task fails the task (never retried) and the flow. Prefect logs that
failure with its traceback, and that record still goes to the Prefect run log (the API handler) in full; on the
terminal, the console handlers drop the records of such a failure, and the command prints the error's sentence
the same way as an error found before the flow started.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TypeVar

from rlhf.errors import UserInputError

T = TypeVar("T")
_NAMES = tuple(cls.__name__ for cls in (UserInputError, *UserInputError.__subclasses__()))


def user_error(err: BaseException | None) -> UserInputError | None:
    """The user error behind `err` (itself, or one in its cause/context chain), else None."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, UserInputError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


class HideUserErrorRecords(logging.Filter):
    """Drops warning-or-worse records about a user error (Prefect's 'Finished in state Failed(...DataError...)'
    lines and tracebacks); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return "encountered an exception" not in str(record.msg) or not self._names_user_error(record)
        if record.exc_info and user_error(record.exc_info[1]) is not None:
            return False
        return not self._names_user_error(record)

    @staticmethod
    def _names_user_error(record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 (a malformed record is not ours to judge)
            return False
        return any(f"{name}:" in message or f"{name}(" in message for name in _NAMES)


def quiet_user_errors_on_console() -> None:
    """Attach the filter to the console (stream) handlers of the root and Prefect loggers, not to the API one."""
    the_filter = HideUserErrorRecords()
    for logger in (logging.getLogger(), logging.getLogger("prefect")):
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not any(
                isinstance(f, HideUserErrorRecords) for f in handler.filters
            ):
                handler.addFilter(the_filter)


def exit_code_of(run: Callable[[], T]) -> tuple[int, T | None]:
    """Run a flow call; a user error anywhere inside it becomes `error: <sentence>` on stderr and exit code 2."""
    quiet_user_errors_on_console()
    try:
        return 0, run()
    except Exception as err:
        cause = user_error(err)
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr)
        return 2, None
