"""The shared base of the config sections, the one pydantic-error formatter and the one YAML reader."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from rlhf.errors import ConfigError

# the loc entries pydantic adds for the branches of a union (a sweep value is `list[Any] | Range`)
_UNION_BRANCHES = ("list[any]", "Range")


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated too, and a float is a finite number
    (``inf``, ``.inf``, ``nan`` or ``1e999`` for a learning rate, a coefficient or a clip range is refused here,
    before anything trains, instead of a loss that is NaN from the first step)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # old key -> new key: a key renamed in this release, still read under its old name with a one-line warning
    # (docs/config.md's "Renamed keys"); the section's name prefixes them in the warning
    renamed_keys: ClassVar[dict[str, str]] = {}
    section_name: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _read_renamed_keys(cls, data: Any) -> Any:
        if not cls.renamed_keys or not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in cls.renamed_keys.items():
            if old not in data:
                continue
            where = f"{cls.section_name}." if cls.section_name else ""
            if new in data:
                raise ValueError(f"{where}{old} was renamed {where}{new}: give only {where}{new}")
            data[new] = cls.renamed_value(old, data.pop(old), data)
            warn_renamed(f"{where}{old}", f"{where}{new}")
        return data

    @classmethod
    def renamed_value(cls, old: str, value: Any, data: dict[str, Any]) -> Any:
        """The new key's value for the old key's `value` (the same, unless the meaning changed with the name)."""
        return value


_warned: set[str] = set()
LOG = logging.getLogger("rlhf.config")


def warn_once(key: str, line: str) -> None:
    """One line, once per process for each `key`: a config that a release reads differently from before."""
    if key not in _warned:
        _warned.add(key)
        LOG.warning(line)


def warn_renamed(old: str, new: str) -> None:
    """One line, once per process: the config used a key's old name."""
    warn_once(old, f"warning: {old} is renamed {new}; the old name is read until the next release")


def renamed_keys_table(sections: dict[str, type[Section]]) -> str:
    """The renamed keys of the given sections (name -> model) as a markdown table."""
    rows = ["| before | now |", "| --- | --- |"]
    for name, model in sections.items():
        rows += [f"| `{name}.{old}` | `{name}.{new}` |" for old, new in model.renamed_keys.items()]
    return "\n".join(rows)


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
