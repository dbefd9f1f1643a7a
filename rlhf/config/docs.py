"""The config reference page, docs/config.md, generated from the config models (``make docs``; a test keeps it
current)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel

from rlhf.config.base import Section, renamed_keys_table
from rlhf.config.pipeline import PipelineConfig, flatten, load_config
from rlhf.config.sections import TRACKING_URI_ENV

ROOT = Path(__file__).resolve().parents[2]
# The config `make run` uses (the embedded default): its values are shown where they differ from the model's defaults.
DEFAULT_YAML = ROOT / "conf" / "default.yaml"
# The page that holds the reference, between the two markers; the prose around them is written by hand.
CONFIG_PAGE = ROOT / "docs" / "config.md"
REFERENCE_START, REFERENCE_END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def reference_markdown(default_yaml: str | Path | None = DEFAULT_YAML) -> str:
    """The config reference: every key with its type, its default in the config model (what a YAML file that leaves
    the key out gets), the value `make run` uses where conf/default.yaml sets another, and its description."""
    with _environment_without(TRACKING_URI_ENV):  # the page shows the defaults of a machine that sets none
        return _reference_markdown(default_yaml)


@contextmanager
def _environment_without(name: str) -> Iterator[None]:
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def _reference_markdown(default_yaml: str | Path | None) -> str:
    used: dict[str, object] = {}
    if default_yaml is not None and Path(default_yaml).is_file():
        used = flatten(load_config(default_yaml))
    model_defaults = flatten(PipelineConfig())
    rows = [
        "| key | type | default | `make run` value | description |",
        "| --- | --- | --- | --- | --- |",
    ]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            key = f"{prefix}{name}"
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, key + ".")
                continue
            default = field.default_factory() if field.default_factory is not None else field.default
            type_name = str(ann).replace("typing.", "").replace("<class '", "").replace("'>", "").replace("|", "\\|")
            text = (field.description or "").replace("|", "\\|")
            default_text = json.dumps(default) if not isinstance(default, BaseModel) else ""
            differs = key in used and used[key] != model_defaults.get(key)
            run_value = f"**`{json.dumps(used[key])}`**" if differs else ""
            rows.append(f"| `{key}` | `{type_name}` | `{default_text}` | {run_value} | {text} |")

    walk(PipelineConfig, "")
    renamed = {
        name: field.annotation
        for name, field in PipelineConfig.model_fields.items()
        if isinstance(field.annotation, type)
        and issubclass(field.annotation, Section)
        and field.annotation.renamed_keys
    }
    rows += ["", "Keys renamed in this release, still read under the old name with a one-line warning:", ""]
    rows.append(renamed_keys_table(renamed))
    return "\n".join(rows)


def current_reference(path: str | Path = CONFIG_PAGE) -> str:
    """The reference as the page has it now: the text between its markers (ValueError when they are missing)."""
    path = Path(path)
    text = path.read_text()
    if REFERENCE_START not in text or REFERENCE_END not in text:
        raise ValueError(f"{path} has no {REFERENCE_START} ... {REFERENCE_END} markers to hold the config reference")
    return text.split(REFERENCE_START, 1)[1].split(REFERENCE_END, 1)[0].strip()


def update_reference(path: str | Path = CONFIG_PAGE) -> bool:
    """Write the config reference between the page's markers; True when it changed."""
    path = Path(path)
    current_reference(path)  # the markers are there
    text = path.read_text()
    head, rest = text.split(REFERENCE_START, 1)
    _, tail = rest.split(REFERENCE_END, 1)
    new = f"{head}{REFERENCE_START}\n{reference_markdown()}\n{REFERENCE_END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    if "--write" in sys.argv:
        print(f"{CONFIG_PAGE} updated" if update_reference() else f"{CONFIG_PAGE} already current")
    else:
        print(reference_markdown())
