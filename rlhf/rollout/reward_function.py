"""Rule-based rewards: a Python callable ``(prompts: list[str], responses: list[str]) -> list[float]`` scores the
responses instead of (``reward.source: function``) or on top of (``reward.function_weight``) the reward model.
Several (``reward.functions`` with ``reward.weights``, TRL's ``reward_funcs``) score their weighted sum, each one's
scores kept apart for the statistics (``RewardFunctions``).

A function may also take the data set's own columns as keyword arguments (TRL's convention,
``reward(prompts, completions, instruction_id_list, kwargs)``, or ``**kwargs`` for all of them): the columns
``data.row_columns`` keeps reach it row by row, looked up by each row's key (``rlhf.rollout.rows``).

The callable is named ``"module:callable"`` (``rlhf.data.synthetic:gold_reward`` is the built-in task's gold
reward) and must be importable in the run's environment. Every way it can go wrong is one sentence naming the
function (and the row where one is to blame): it cannot be imported, it raises, it returns the wrong number of
values, or a value that is not a finite number. ``function_digest`` is part of the cache key of every stage that
scores with it: the function's name and its source file's digest.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhf.config import RewardConfig
from rlhf.errors import ConfigError, UserInputError
from rlhf.rollout.rows import RowColumns, wanted_columns

RewardCallable = Callable[..., Sequence[float]]  # (prompts, responses, **row_columns) -> one score per response


class RewardFunctionError(UserInputError):
    """A reward function that cannot be used: the message names the function, and the row where one is to blame."""


@dataclass(frozen=True)
class RewardFunction:
    spec: str  # "module:callable"
    fn: RewardCallable
    columns: RowColumns | None = None  # the data's row columns, for a function that takes them

    def with_columns(self, columns: RowColumns | None) -> RewardFunction:
        """This function, given the row columns of the prompts it will score."""
        return RewardFunction(self.spec, self.fn, columns)

    def column_kwargs(self, rows: list[str] | None) -> dict[str, list]:
        """The row columns the function takes, one value per row key (none for a two-argument function)."""
        wanted = wanted_columns(self.fn)
        if not wanted.named and not wanted.takes_all:
            return {}
        if self.columns is None:
            if wanted.required:
                raise RewardFunctionError(
                    f"reward function {self.spec} takes the keyword argument '{wanted.required[0]}' but the data "
                    "keeps no row columns: set data.row_columns"
                )
            return {}
        if rows is None:
            raise ValueError(f"reward function {self.spec} takes row columns: each response's row key is needed")
        return self.columns.values(rows, wanted.of(self.columns.names))

    @property
    def has_categories(self) -> bool:
        """Whether the function sorts rows into categories: a `categories` attribute that takes the same row
        columns and returns one list of names per row (`rlhf.data.verifiers.ifeval_strict`: its instruction
        types), which the statistics break down by."""
        return callable(getattr(self.fn, "categories", None))

    def categories(self, rows: list[str] | None) -> list[list[str]]:
        """The categories of each row (`has_categories`), by row key."""
        return [list(names) for names in self.fn.categories(**self.column_kwargs(rows))]  # type: ignore[attr-defined]

    def __call__(self, prompts: list[str], responses: list[str], rows: list[str] | None = None) -> list[float]:
        """The scores of the (prompt, response) pairs, checked: one finite float per pair; `rows`: each pair's row
        key, for a function that takes row columns."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        kwargs = self.column_kwargs(rows)
        try:
            values = self.fn(list(prompts), list(responses), **kwargs)
        except Exception as err:  # noqa: BLE001 (the user's code: any error is reported in one sentence)
            raise RewardFunctionError(
                f"reward function {self.spec} raised {type(err).__name__}: {_first_line(err)} (on a batch of "
                f"{len(prompts)} responses)"
            ) from err
        try:
            scores = [float(v) for v in values]
        except (TypeError, ValueError) as err:
            raise RewardFunctionError(
                f"reward function {self.spec} must return a list of numbers, one per response; it returned "
                f"{type(values).__name__} ({_first_line(err)})"
            ) from err
        if len(scores) != len(prompts):
            raise RewardFunctionError(
                f"reward function {self.spec} returned {len(scores)} values for {len(prompts)} responses: it must "
                "return one per response"
            )
        for row, score in enumerate(scores):
            if not math.isfinite(score):
                raise RewardFunctionError(
                    f"reward function {self.spec} returned {score} for row {row} of a batch (prompt "
                    f"{_clip(prompts[row])!r}, response {_clip(responses[row])!r}): every score must be finite"
                )
        return scores


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else "no message"


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_reward_function(spec: str, key: str = "reward.function") -> RewardFunction:
    """The callable named ``"module:callable"`` (dotted attributes allowed after the colon), or ConfigError naming
    `key` when the name is malformed, the module does not import or the attribute is missing or not callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} must be 'module:callable' (e.g. rlhf.data.synthetic:gold_reward), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 (any import failure of the user's module is one sentence)
        raise ConfigError(
            f"{key}: module {module_name!r} of {spec} cannot be imported ({type(err).__name__}: {_first_line(err)}); "
            "it must be importable in the run's environment (installed, or on PYTHONPATH)"
        ) from err
    target: object = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r} (from {spec})")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key}: {spec} is a {type(target).__name__}, not a callable")
    return RewardFunction(spec, target)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RewardFunctions:
    """Reward functions with their weights (reward.functions and reward.weights, TRL's reward_funcs and
    reward_weights; reward.function is a list of one): the score is the weighted sum of theirs, and `parts` gives
    each one's own scores, which the statistics log under `names`."""

    functions: tuple[RewardFunction, ...]
    weights: tuple[float, ...]

    @property
    def spec(self) -> str:
        return ", ".join(function.spec for function in self.functions)

    @property
    def names(self) -> list[str]:
        """Each function's name in the metrics (rewards/<name>/mean): the callable's name, numbered from the second
        where two share one."""
        names: list[str] = []
        for function in self.functions:
            base = function.spec.rpartition(":")[2].rpartition(".")[2]
            name, n = base, 1
            while name in names:
                n += 1
                name = f"{base}_{n}"
            names.append(name)
        return names

    def with_columns(self, columns: RowColumns | None) -> RewardFunctions:
        """These functions, given the row columns of the prompts they will score."""
        return RewardFunctions(tuple(function.with_columns(columns) for function in self.functions), self.weights)

    @property
    def has_categories(self) -> bool:
        """Whether one of the functions sorts rows into categories (`RewardFunction.has_categories`)."""
        return any(function.has_categories for function in self.functions)

    def categories(self, rows: list[str] | None) -> list[list[str]]:
        """The categories of each row, by the first function that has them."""
        return next(function for function in self.functions if function.has_categories).categories(rows)

    def parts(self, prompts: list[str], responses: list[str], rows: list[str] | None = None) -> list[list[float]]:
        """Each function's own (unweighted, checked) scores of the pairs (`rows`: their row keys): one list per
        function."""
        return [function(prompts, responses, rows) for function in self.functions]

    def combine(self, parts: list[list[float]]) -> list[float]:
        """The weighted sum of `parts` (one list per function), per pair."""
        if len(self.functions) == 1 and self.weights == (1.0,):
            return list(parts[0])
        return [sum(w * s for w, s in zip(self.weights, row, strict=True)) for row in zip(*parts, strict=True)]

    def __call__(self, prompts: list[str], responses: list[str], rows: list[str] | None = None) -> list[float]:
        """The weighted sum of the functions' scores of the (prompt, response) pairs (`rows`: their row keys)."""
        return self.combine(self.parts(prompts, responses, rows))


def load_reward_functions(specs: list[str], weights: list[float] | None = None) -> RewardFunctions:
    """The callables `specs` names with their `weights` (all 1 where None); each import failure is a ConfigError
    naming its key (reward.function, or reward.functions[i] of a list of several)."""
    keys = ["reward.function"] if len(specs) == 1 else [f"reward.functions[{i}]" for i in range(len(specs))]
    functions = tuple(load_reward_function(spec, key) for spec, key in zip(specs, keys, strict=True))
    return RewardFunctions(functions, tuple(weights) if weights is not None else (1.0,) * len(specs))


def reward_function(
    reward_cfg: RewardConfig | None, columns: RowColumns | None = None
) -> tuple[RewardFunctions | None, float]:
    """The reward functions of `reward_cfg` (reward.functions or reward.function) with their weights, given the
    prompts' row `columns`, and the weight of their sum beside a reward model (reward.function_weight for the one
    reward.function, 1 for a list or where they score alone); (None, 1.0) where none is used."""
    if reward_cfg is None or not reward_cfg.uses_function:
        return None, 1.0
    beside_model = reward_cfg.source == "model" and reward_cfg.functions is None
    weight = reward_cfg.function_weight if beside_model else 1.0
    functions = load_reward_functions(reward_cfg.function_specs, reward_cfg.function_weights)
    return functions.with_columns(columns), weight


def function_digest(spec: str | list[str], weights: list[float] | None = None) -> str:
    """The functions' names (and weights) and their source files' content digests: what a stage scoring with them
    is cached on (a changed rule recomputes the stage). Functions without a source file (builtins) are keyed on the
    name alone. A single name digests as it always has."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    weights = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
    if len(specs) == 1 and weights == [1.0]:
        return _one_digest(specs[0])
    h = hashlib.sha256(repr(weights).encode())
    for one in specs:
        h.update(_one_digest(one).encode())
    return h.hexdigest()[:16]


def _one_digest(spec: str) -> str:
    fn = load_reward_function(spec).fn
    try:
        source = inspect.getsourcefile(inspect.unwrap(fn))
    except TypeError:
        source = None
    h = hashlib.sha256(spec.encode())
    if source and Path(source).is_file():
        h.update(Path(source).read_bytes())
    return h.hexdigest()[:16]
