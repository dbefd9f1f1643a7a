"""The README's config reference, generated from the config models (``make docs``; a test keeps it current)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from rlhf.config.pipeline import PipelineConfig, flatten, load_config

# The config `make run` uses (the README's "embedded default"): its values are shown where they differ from the
# model's defaults.
DEFAULT_YAML = Path(__file__).resolve().parents[2] / "conf" / "default.yaml"


def reference_markdown(default_yaml: str | Path | None = DEFAULT_YAML) -> str:
    """The README's config reference: every key with its type, its default in the config model (what a YAML file
    that leaves the key out gets), the value `make run` uses where conf/default.yaml sets another, and its
    description."""
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
