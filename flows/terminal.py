"""What a user sees on the terminal when a run stops: one sentence, no traceback, and an exit code that says why.

Exit codes of ``rlhf run``, ``rlhf sweep``, ``python -m flows.pipeline`` and ``python -m flows.sweep``:

===  ==================================================================================================================
0    finished
1    anything not anticipated (a bug, a library failure): its traceback
2    bad input: the config, the data, a model folder or the environment (a device that is not there, a server that
     does not answer), found before anything trained or by the stage that read it (`EXIT_USER_ERROR`)
3    a loss or gradient norm became NaN or infinite during training (NonFiniteError): the last saved state is kept
     and a rerun resumes from it (`EXIT_NON_FINITE`)
4    a checkpoint or stage output could not be written: the disk is full (CheckpointWriteError); the previous one is
     intact (`EXIT_DISK_FULL`)
5    the MLflow tracking server stopped answering during the run; what was trained is kept (`EXIT_TRACKING_LOST`)
130  stopped by Ctrl-C (SIGINT); 143: stopped by SIGTERM. The finished stages and the last saved training state are
     kept, the MLflow runs of the run end KILLED and the temporary Prefect server stops with it (`stop_on_signals`)
===  ==================================================================================================================

A user error or an anticipated failure raised inside a task fails the task (never retried) and the flow. Prefect logs
that failure with its traceback, and that record still goes to the Prefect run log (the API handler) in full; on the
terminal, the console handlers drop the records of such a failure, and the command prints its sentence the same way
as an error found before the flow started: ``error: <sentence>`` on stderr.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from flows.temporary_server import temporary_server_in_own_session
from rlhf.errors import CheckpointWriteError, NonFiniteError, UserInputError
from rlhf.stop_request import request_stop

T = TypeVar("T")
EXIT_USER_ERROR, EXIT_NON_FINITE, EXIT_DISK_FULL, EXIT_TRACKING_LOST = 2, 3, 4, 5
_ANTICIPATED = (UserInputError, NonFiniteError, CheckpointWriteError)
_NAMES = tuple(
    cls.__name__ for cls in (*_ANTICIPATED, *UserInputError.__subclasses__(), *CheckpointWriteError.__subclasses__())
)
# MLflow's REST client, when the server is gone: "API request to http://host:5000/api/2.0/mlflow/... failed with
# exception HTTPConnectionPool(...): Max retries exceeded ... Connection refused"
_TRACKING_LOST = re.compile(
    r"API request to (?P<url>https?://[^/\s]+)\S* failed with exception .*"
    r"(Max retries exceeded|Connection refused|Failed to establish|NewConnectionError|Read timed out|"
    r"RemoteDisconnected|Connection aborted)",
    re.S,
)


def user_error(err: BaseException | None) -> UserInputError | None:
    """The user error behind `err` (itself, or one in its cause/context chain), else None."""
    return next((e for e in _chain(err) if isinstance(e, UserInputError)), None)


def _chain(err: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and all(err is not e for e in seen):
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


class Failure(NamedTuple):
    """An anticipated failure during a run: its exit code and its one sentence."""

    code: int
    sentence: str


def anticipated_failure(err: BaseException | None) -> Failure | None:
    """What `err` is, when it is one of the failures a run anticipates: a user error, a non-finite loss, a full disk,
    a tracking server gone; None for anything else."""
    for inner in _chain(err):
        if isinstance(inner, UserInputError):
            return Failure(EXIT_USER_ERROR, str(inner))
        if isinstance(inner, NonFiniteError):
            return Failure(EXIT_NON_FINITE, str(inner))
        if isinstance(inner, CheckpointWriteError):
            return Failure(
                EXIT_DISK_FULL,
                f"{inner}; free space on that disk and run the same command again: it continues from the last saved "
                "state",
            )
        lost = _TRACKING_LOST.search(str(inner))
        if lost:
            return Failure(
                EXIT_TRACKING_LOST,
                f"the MLflow tracking server at {lost['url']} stopped answering during the run; the finished stages "
                "and the last saved training state are kept: start the server again and run the same command (it "
                "continues where this one stopped)",
            )
    return None


class HideUserErrorRecords(logging.Filter):
    """Drops warning-or-worse records about a user error or an anticipated failure (Prefect's 'Finished in state
    Failed(...DataError...)' lines and tracebacks); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return "encountered an exception" not in str(record.msg) or not self._names_user_error(record)
        if record.exc_info and anticipated_failure(record.exc_info[1]) is not None:
            return False
        return not self._names_user_error(record)

    @staticmethod
    def _names_user_error(record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 (a malformed record is not ours to judge)
            return False
        if any(f"{name}:" in message or f"{name}(" in message for name in _NAMES):
            return True
        return "MlflowException" in message and _TRACKING_LOST.search(message) is not None


# A log record's attribute (`extra={BROWSER_ONLY: True}`): the command prints the same text itself, so the record is
# for the flow run's log in the Prefect UI (the summary at the end of a run), not for the terminal a second time.
BROWSER_ONLY = "rlhf_browser_only"


class HidePrintedRecords(logging.Filter):
    """Drops the records marked `BROWSER_ONLY`; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, BROWSER_ONLY, False)


def quiet_user_errors_on_console() -> None:
    """Attach the filters (`HideUserErrorRecords`, `HidePrintedRecords`) to the console (stream) handlers of the root
    and Prefect loggers, not to the API one."""
    for the_filter in (HideUserErrorRecords(), HidePrintedRecords()):
        for logger in (logging.getLogger(), logging.getLogger("prefect")):
            for handler in logger.handlers:
                if isinstance(handler, logging.StreamHandler) and not any(
                    isinstance(f, type(the_filter)) for f in handler.filters
                ):
                    handler.addFilter(the_filter)


# -- Stopping on Ctrl-C and SIGTERM --------------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by SIGINT or SIGTERM once `stop_on_signals` is in place: a KeyboardInterrupt, so
    Prefect and the stages unwind as they do for Ctrl-C (the stage's state saved so far is kept)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Stop:
    signum: int | None = None
    at: float = 0.0  # time.time() of the first signal
    tracking: tuple[Any, ...] = ()  # the TrackingConfig (uri, experiment) of each store the run logs to


def _note(signum: int) -> None:
    """The first SIGINT or SIGTERM: its number and time (the runs that ended after it ended because of it)."""
    request_stop()  # the worker threads' trainers stop at their next step (a sweep's variants)
    if _Stop.signum is None:
        _Stop.signum, _Stop.at = signum, time.time()
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n{name}: stopping (the state saved so far is kept) ...", file=sys.stderr, flush=True)


def _on_signal(signum: int, frame: Any) -> None:
    _note(signum)
    raise Interrupted(signum)


@functools.cache
def _note_prefect_sigterm() -> None:
    """While a flow runs, Prefect's own SIGTERM handler is in place (it raises TerminationSignal, records the crash,
    then sends the signal again to the handler before it: `_on_signal`): note the signal's time when it comes."""
    try:
        from prefect.utilities import engine as prefect_engine
    except ImportError:  # pragma: no cover
        return
    original = getattr(prefect_engine, "_prefect_sigterm_handler", None)
    if original is None:  # pragma: no cover (another Prefect: the time is noted when the signal reaches _on_signal)
        return

    @functools.wraps(original)
    def handler(signum: int, frame: Any) -> Any:
        _note(signum)
        return original(signum, frame)

    prefect_engine._prefect_sigterm_handler = handler


def stop_on_signals(*tracking: Any) -> None:
    """Make Ctrl-C (SIGINT) and SIGTERM stop this command within seconds, in a terminal or as a service: both raise
    `Interrupted` in the main thread (the running stage unwinds, keeping the state it saved), `exit_code_of` then
    ends the command's MLflow runs (in the stores of the `tracking` configs) KILLED and returns 128 + the signal's
    number, and the temporary Prefect server stops at exit (Prefect's own SIGTERM handling killed the process before
    its exit handlers ran, leaving that server behind). The temporary server runs in a session of its own, so a
    terminal's Ctrl-C (sent to the whole foreground process group) no longer stops it while the run still records
    its end in it; it is stopped at exit, or by the kernel when this process dies (SIGKILL). Call it in a command's
    main(), before the flow; the main thread only."""
    _Stop.tracking = tuple(tracking)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    _note_prefect_sigterm()
    temporary_server_in_own_session()


class _QuietAfterStop(logging.Filter):
    """Drops every console record once a served flow run is being stopped (the run log keeps them)."""

    stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.stopping


def quiet_stop_in_served_run() -> None:
    """In a flow run of a deployment that `make ui` serves (a process of its own, in the serve process's group, which
    Ctrl-C on `make ui` signals): the first SIGINT prints one sentence on the console and silences its console
    handlers, then stops the run as Ctrl-C does (a KeyboardInterrupt: the stages end their MLflow runs KILLED and keep
    their saved state). Without it the flow engine printed the interrupted stage's traceback (some 100 lines). The
    records still reach the flow run's log in the Prefect UI. Nothing changes outside a deployment's run (the CLI has
    `stop_on_signals`) or off the main thread (a sweep's variants)."""
    from prefect.runtime import deployment, flow_run

    previous = signal.getsignal(signal.SIGINT)
    if deployment.id is None or threading.current_thread() is not threading.main_thread() or previous is _on_served:
        return
    quiet = _QuietAfterStop()
    for logger in (logging.getLogger(), logging.getLogger("prefect")):
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.addFilter(quiet)
    _Served.previous, _Served.quiet, _Served.run_name = previous, quiet, flow_run.name
    signal.signal(signal.SIGINT, _on_served)


class _Served:
    previous: Any = signal.default_int_handler
    quiet: _QuietAfterStop | None = None
    run_name = ""


def _on_served(signum: int, frame: Any) -> None:
    if _Served.quiet is not None and not _Served.quiet.stopping:
        _Served.quiet.stopping = True
        sys.stderr.write(
            f"flow run '{_Served.run_name}' stopped by Ctrl-C (SIGINT): its finished stages and last saved training "
            "state are kept and its MLflow runs end KILLED; start it again from the same form to continue\n"
        )
        sys.stderr.flush()
    handler = _Served.previous
    if callable(handler):
        handler(signum, frame)
    raise KeyboardInterrupt


SERVED_STOP = "stopped by Ctrl-C on make ui"  # the message of a served run's Cancelled state


def cancel_served_run(err: BaseException) -> bool:
    """A served flow run that Ctrl-C on `make ui` stopped (`_on_served`; `err` its KeyboardInterrupt): the flow run
    Cancelled in Prefect, as the terminal says and its MLflow runs end (KILLED), not Crashed. Prefect's engine records
    any KeyboardInterrupt as a crash unless the run's state is final already, so the state is set here, before the
    interrupt leaves the flow, and on the engine's copy of the run too; the runner's later Crashed is then refused by
    the server (a run in a terminal state does not become Crashed). Whether the run was cancelled."""
    if not isinstance(err, KeyboardInterrupt) or _Served.quiet is None or not _Served.quiet.stopping:
        return False
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.states import Cancelled

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return False
    state = Cancelled(
        message=f"{SERVED_STOP}: its finished stages and last saved training state are kept and its MLflow runs "
        "ended KILLED; start it again from the same form to continue"
    )
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal does not cut the call short
    try:
        with get_client(sync_client=True) as client:
            result = client.set_flow_run_state(context.flow_run.id, state, force=True)
        context.flow_run.state = result.state or state
        return True
    except Exception as failed:  # noqa: BLE001 (the run is then recorded Crashed, as before)
        print(f"warning: the flow run could not be marked Cancelled: {failed}", file=sys.stderr)
        return False
    finally:
        signal.signal(signal.SIGINT, ignored)


@contextlib.contextmanager
def served_stop_cancels():
    """`cancel_served_run` for the flow body inside: a served run stopped by Ctrl-C ends Cancelled."""
    try:
        yield
    except KeyboardInterrupt as err:
        cancel_served_run(err)
        raise


def _end_runs_killed(since: float) -> list[str]:
    """The MLflow runs this process started or reopened that are still RUNNING, or that ended after `since` (the
    stages end theirs FAILED on the way out), ended KILLED. Returns their ids."""
    # heavy: MLflow (this module is imported by the commands before their checks, which stay instant)
    from rlhf.tracking.client import Tracker
    from rlhf.tracking.store import PID_TAG

    ended = []
    for tracking in _Stop.tracking:
        try:
            tracker = Tracker(tracking.uri, tracking.experiment, getattr(tracking, "artifact_location", None))
            for run in tracker.search_runs(f"tags.`{PID_TAG}` = '{os.getpid()}'"):
                if run.status == "RUNNING" or (run.status == "FAILED" and (run.end_time or 0) >= since * 1000 - 1):
                    tracker.client.set_terminated(run.run_id, status="KILLED")
                    ended.append(run.run_id)
        except Exception as err:  # noqa: BLE001 (the next run marks what is left: Tracker.end_orphaned_runs)
            print(f"warning: the MLflow runs could not be marked KILLED: {err}", file=sys.stderr)
    return ended


def _stopped(signum: int) -> int:
    """After Ctrl-C or SIGTERM: the command's MLflow runs ended KILLED, one sentence, 128 + the signal's number."""
    ignore = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}  # cleanup: seconds
    try:
        _end_runs_killed(_Stop.at)
    finally:
        for s, handler in ignore.items():
            signal.signal(s, handler)
    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    print(
        f"stopped by {name}: the finished stages and the last saved training state are kept and the MLflow runs "
        "ended KILLED; run the same command to continue",
        file=sys.stderr,
    )
    return 128 + signum


def stopped_before_the_flow(signum: int) -> int:
    """After Ctrl-C or SIGTERM during the checks before the flow (nothing trained, no MLflow run started): one
    sentence, 128 + the signal's number."""
    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    print(f"stopped by {name} before the run started: nothing was trained or logged", file=sys.stderr)
    return 128 + signum


def prefect_api_problem(timeout: float = 5.0) -> str | None:
    """The sentence for a Prefect server that PREFECT_API_URL (the environment or the Prefect profile) names and that
    does not answer: without it the flow would retry its first call for minutes, then end in a traceback (Prefect
    3.9's `api_healthcheck()` goes through that retrying client, so one plain GET /health asks)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return None
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout)
    except httpx.HTTPError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return (
            f"PREFECT_API_URL is {url}, but no Prefect server answers there ({reason}); start it (make ui, or "
            "prefect server start) or unset PREFECT_API_URL to run with a temporary server"
        )
    return None


def exit_code_of(run: Callable[[], T]) -> tuple[int, T | None]:
    """Run a flow call; a user error or an anticipated failure anywhere inside it becomes ``error: <sentence>`` on
    stderr and its exit code (the module's table), Ctrl-C or SIGTERM (with `stop_on_signals`) 130 or 143. A Prefect
    server named by PREFECT_API_URL that does not answer is a user error before the flow starts."""
    quiet_user_errors_on_console()
    problem = prefect_api_problem()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USER_ERROR, None
    try:
        return 0, run()
    except BaseException as err:
        failure = anticipated_failure(err)
        if failure is not None:
            print(f"error: {failure.sentence}", file=sys.stderr)
            return failure.code, None
        if _Stop.signum is not None and not isinstance(err, SystemExit):
            return _stopped(_Stop.signum), None
        raise
