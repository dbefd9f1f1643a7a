"""The README's config reference, generated from the config models (``make docs``; a test keeps it current)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from rlhf.config.pipeline import PipelineConfig


def reference_markdown() -> str:
    """The README's config reference: every key with its type, default and description."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]

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
            rows.append(f"| `{key}` | `{type_name}` | `{default_text}` | {text} |")

    walk(PipelineConfig, "")
    return "\n".join(rows)


README_START, README_END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def update_readme(path: str | Path = "README.md") -> bool:
    """Write the config reference between the README's markers; True when it changed."""
    path = Path(path)
    text = path.read_text()
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    new = f"{head}{README_START}\n{reference_markdown()}\n{README_END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    if "--write-readme" in sys.argv:
        print("README.md updated" if update_readme() else "README.md already current")
    else:
        print(reference_markdown())
