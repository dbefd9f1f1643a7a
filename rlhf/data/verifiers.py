"""The field's instruction-following verifiers, offline: IFEval's and IFBench's checkers from ``if-verifiable``.

IFEval (Zhou et al. 2023, 25 instruction types) and IFBench (Pyatkin et al. 2025, 58 held-out types) state each
prompt's instructions as a row: ``instruction_id_list`` (e.g. ``["punctuation:no_comma"]``) and ``kwargs`` (one
dict of arguments per instruction). A response follows an instruction **strictly** when the checker accepts it as
it is, **loosely** when it accepts one of its variants without the first or last line or without ``*`` (the papers'
loose criterion, ``if_verifiable.common.get_loose_transformations``).

Offline: importing IFBench's checkers calls ``nltk.download``, which this module turns off for the import, and a
few checkers need NLTK data (punkt, the POS tagger, stopwords) that no working wheel ships. Where the data is
missing, those instructions are **not scorable**: they are left out of both the numerator and the denominator, and
counted (``Score.unscorable``). Without NLTK data that is IFEval's ``length_constraints:number_sentences`` and
``change_case:capital_word_frequency`` and IFBench's ``ratio:stop_words``, ``words:start_verb``,
``format:title_case`` and ``words:words_position``; with the data installed (``nltk.download``), every type scores.

The reward functions (``reward.function`` / ``data.gold_reward``) take the rows' columns by name, TRL's convention:
``ifeval_strict(prompts, completions, instruction_id_list, kwargs)`` is the share of a prompt's instructions the
response follows strictly, in [0, 1] (``ifeval_loose``: loosely; ``ifbench_*`` with IFBench's checkers).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

from rlhf.errors import DataError

Benchmark = Literal["ifeval", "ifbench"]
BENCHMARKS: tuple[Benchmark, ...] = ("ifeval", "ifbench")


@contextlib.contextmanager
def _no_downloads() -> Iterator[None]:
    """``nltk.download`` does nothing inside (IFBench's module calls it at import: no network here)."""
    import nltk

    download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        yield
    finally:
        nltk.download = download


@functools.cache
def registry(benchmark: Benchmark) -> dict[str, type]:
    """Instruction id -> checker class of IFEval's or IFBench's registry (imported once, with no download)."""
    import langdetect

    langdetect.DetectorFactory.seed = 0  # its detection is random otherwise: the same response, another verdict
    with _no_downloads():
        if benchmark == "ifeval":
            from if_verifiable.ifeval import instructions_registry  # heavy (langdetect, nltk): imported when used
        else:
            from if_verifiable.ifbench import instructions_registry
    return dict(instructions_registry.INSTRUCTION_DICT)


@functools.cache
def conflicts(benchmark: Benchmark) -> dict[str, set[str]]:
    """Instruction id -> the ids it must not be combined with (the registry's own table)."""
    registry(benchmark)
    if benchmark == "ifeval":
        from if_verifiable.ifeval import instructions_registry
    else:
        from if_verifiable.ifbench import instructions_registry
    table = getattr(instructions_registry, "INSTRUCTION_CONFLICTS", {})
    return {key: set(value) for key, value in table.items()}


@functools.cache
def _arguments(benchmark: Benchmark, instruction_id: str) -> frozenset[str]:
    """The keyword arguments a checker's ``build_description`` takes."""
    params = inspect.signature(registry(benchmark)[instruction_id].build_description).parameters
    return frozenset(name for name in params if name != "self")


def plain_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """An instruction's arguments without the nulls (IFEval's and IFBench's files list every key, most null)."""
    return {key: value for key, value in (kwargs or {}).items() if value is not None}


def check_row(instruction_ids: Any, kwargs: Any, benchmark: Benchmark, where: str) -> None:
    """DataError naming `where` (a file and row) for an unknown instruction id, kwargs that do not line up with the
    ids, or arguments the instruction's checker does not take or refuses."""
    if not isinstance(instruction_ids, list) or not instruction_ids:
        raise DataError(f"{where}: instruction_id_list must be a non-empty list of {benchmark} instruction ids")
    if not isinstance(kwargs, list) or len(kwargs) != len(instruction_ids):
        raise DataError(
            f"{where}: kwargs must be a list with one dict per instruction ({len(instruction_ids)}), got "
            f"{type(kwargs).__name__}{f' of {len(kwargs)}' if isinstance(kwargs, list) else ''}"
        )
    known = registry(benchmark)
    for instruction_id, arguments in zip(instruction_ids, kwargs, strict=True):
        if instruction_id not in known:
            raise DataError(
                f"{where}: unknown {benchmark} instruction id {instruction_id!r} (known: {len(known)} ids, e.g. "
                f"{', '.join(sorted(known)[:3])})"
            )
        if arguments is not None and not isinstance(arguments, dict):
            raise DataError(f"{where}: the kwargs of {instruction_id} must be a dict, got {type(arguments).__name__}")
        given = plain_kwargs(arguments)
        unknown = sorted(set(given) - _arguments(benchmark, instruction_id))
        if unknown:
            raise DataError(
                f"{where}: {instruction_id} takes no argument {unknown[0]!r} (it takes: "
                f"{', '.join(sorted(_arguments(benchmark, instruction_id))) or 'none'})"
            )
        try:
            known[instruction_id](instruction_id).build_description(**given)
        except Exception as err:  # noqa: BLE001 (the checker's own validation: any refusal is one sentence)
            raise DataError(
                f"{where}: {instruction_id} refuses its kwargs {given} ({type(err).__name__}: {err})"
            ) from err


class Score(NamedTuple):
    """One response against its prompt's instructions: per instruction, followed strictly / loosely, or None where
    the checker needs NLTK data that is not installed (not scorable)."""

    instruction_ids: list[str]
    strict: list[bool | None]
    loose: list[bool | None]

    @property
    def unscorable(self) -> int:
        return sum(s is None for s in self.strict)

    def share(self, loose: bool = False) -> float:
        """The share of the scorable instructions followed (0 where none is scorable)."""
        values = [v for v in (self.loose if loose else self.strict) if v is not None]
        return sum(values) / len(values) if values else 0.0

    def all_followed(self, loose: bool = False) -> bool | None:
        """Every scorable instruction followed (the prompt-level criterion); None where none is scorable."""
        values = [v for v in (self.loose if loose else self.strict) if v is not None]
        return all(values) if values else None


def score(
    prompt: str, response: str, instruction_ids: list[str], kwargs: list[dict | None], benchmark: Benchmark
) -> Score:
    """Check `response` against each instruction with the benchmark's checker, strict and loose; `prompt` is the
    user's prompt (a few checkers read it)."""
    from if_verifiable.common import evaluate_instructions  # with the registry: imported when used

    known = registry(benchmark)
    strict: list[bool | None] = []
    loose: list[bool | None] = []
    for instruction_id, arguments in zip(instruction_ids, kwargs, strict=True):
        try:
            results, _ = evaluate_instructions(response, [instruction_id], [plain_kwargs(arguments)], prompt, known)
        except LookupError:  # NLTK data this checker needs is not installed: not scorable
            strict.append(None)
            loose.append(None)
            continue
        # no result: an empty response (or only a thinking block), which follows nothing
        strict.append(bool(results and results[0].strict_pass))
        loose.append(bool(results and results[0].loose_pass))
    return Score(list(instruction_ids), strict, loose)


def _shares(
    prompts: list[str],
    completions: list[str],
    instruction_id_list: list,
    kwargs: list,
    benchmark: Benchmark,
    loose: bool,
) -> list[float]:
    return [
        score(p, c, ids, kw, benchmark).share(loose)
        for p, c, ids, kw in zip(prompts, completions, instruction_id_list, kwargs, strict=True)
    ]


def ifeval_strict(prompts: list[str], completions: list[str], instruction_id_list: list, kwargs: list) -> list[float]:
    """Reward: the share of each prompt's IFEval instructions the completion follows strictly, in [0, 1]."""
    return _shares(prompts, completions, instruction_id_list, kwargs, "ifeval", loose=False)


def ifeval_loose(prompts: list[str], completions: list[str], instruction_id_list: list, kwargs: list) -> list[float]:
    """Reward: the share of each prompt's IFEval instructions the completion follows loosely, in [0, 1]."""
    return _shares(prompts, completions, instruction_id_list, kwargs, "ifeval", loose=True)


def ifbench_strict(prompts: list[str], completions: list[str], instruction_id_list: list, kwargs: list) -> list[float]:
    """Reward: the share of each prompt's IFBench instructions the completion follows strictly, in [0, 1]."""
    return _shares(prompts, completions, instruction_id_list, kwargs, "ifbench", loose=False)


def ifbench_loose(prompts: list[str], completions: list[str], instruction_id_list: list, kwargs: list) -> list[float]:
    """Reward: the share of each prompt's IFBench instructions the completion follows loosely, in [0, 1]."""
    return _shares(prompts, completions, instruction_id_list, kwargs, "ifbench", loose=True)


def _row_check(benchmark: Benchmark):
    def check(row: dict[str, Any], where: str) -> None:
        check_row(row.get("instruction_id_list"), row.get("kwargs"), benchmark, where)

    return check


def instruction_types(instruction_id_list: list, **_: Any) -> list[list[str]]:
    """The categories of each row: its instruction types (the PPO stage's `group/zero_std_fraction/<type>`)."""
    return [list(ids) for ids in instruction_id_list]


# The data stage checks every row of a data set whose gold reward carries a `check_row` (rlhf.data.prepare): an
# unknown instruction id or bad kwargs is named by file and row before any model loads. The PPO stage breaks its
# groups without spread down by a reward function's `categories` (rlhf.rollout.reward_function).
for _fn in (ifeval_strict, ifeval_loose):
    _fn.check_row = _row_check("ifeval")  # type: ignore[attr-defined]
for _fn in (ifbench_strict, ifbench_loose):
    _fn.check_row = _row_check("ifbench")  # type: ignore[attr-defined]
for _fn in (ifeval_strict, ifeval_loose, ifbench_strict, ifbench_loose):
    _fn.categories = instruction_types  # type: ignore[attr-defined]
