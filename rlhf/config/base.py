"""The shared base of the config sections, the one pydantic-error formatter and the one YAML reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from rlhf.errors import ConfigError

# the loc entries pydantic adds for the branches of a union (a sweep value is `list[Any] | Range`)
_UNION_BRANCHES = ("list[any]", "Range")


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated too, and a float is a finite number
    (``inf``, ``.inf``, ``nan`` or ``1e999`` for a learning rate, a coefficient or a clip range is refused here,
    before anything trains, instead of a loss that is NaN from the first step)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def format_validation_error(err: ValidationError, source: str) -> str:
    """The first problem of a pydantic validation error as one sentence naming `source` and the key, with a count
    of the others."""
    # a dict given for a `list | Range` value: report the Range's problem, not "should be a valid list"
    errors = sorted(err.errors(), key=lambda e: "list[any]" in e["loc"])
    first = errors[0]
    key = ".".join(str(p) for p in first["loc"] if p not in _UNION_BRANCHES) or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        msg = f"{source}: unknown key '{key}'"
    elif kind == "value_error":
        msg = f"{source}: {str(first['msg']).removeprefix('Value error, ')}"
    elif kind == "finite_number":
        msg = f"{source}: {key} is {first.get('input')}, not a finite number; give it a finite value"
    else:
        got = first.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        msg = f"{source}: {key}: {first['msg']}{got_text}"
    more = len(errors) - 1
    return msg + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


# libyaml's parser where PyYAML was built with it (the wheels are): the same documents, about 10 times faster than
# the pure-Python one; the form's and the sweeps' configs are loaded thousands of times in the tests.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def safe_load(text: str) -> Any:
    """`yaml.safe_load`, with libyaml's parser where there is one."""
    return yaml.load(text, Loader=_SafeLoader)


def read_yaml(path: str | Path, kind: str) -> Any:
    """The content of a YAML file; a missing file or invalid YAML is one ConfigError sentence (`kind` names the
    file, e.g. 'config file')."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{kind} {path} does not exist")
    try:
        return safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
        raise ConfigError(f"{path} is not valid YAML: {problem}{where}") from None
