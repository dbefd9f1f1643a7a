"""A verifiable task from reasoning-gym's procedural generators (``data.source: reasoning_gym``; docs/data.md).

reasoning-gym (an optional extra: ``pip install -e '.[reasoning]'``) makes a task's items from a seed, each a
question, its answer and metadata, and checks a response with the task's own ``score_answer``. This module:

- generates the training items from ``data.task.train_seed`` and the held-out items from ``eval_seed`` (duplicate
  questions dropped, and held-out questions that are also training questions);
- renders each as a chat prompt that asks for the answer in the R1 format (reasoning, then
  ``<answer>...</answer>``), and keeps its truth in two row columns: ``answer`` (the generator's answer) and
  ``entry`` (the JSON text of the rest of the item: task, generator settings, question, metadata);
- writes them as local JSONL files that the prepare stage reads as a ``local`` source (``local_source``);
- scores responses with two reward functions in TRL's convention (``reward.functions``, R1's pair):
  ``correct`` (the task's ``score_answer`` on the extracted answer) and ``formatted`` (the answer tags).

Preference pairs, which the prepare stage writes for every source: chosen is the right answer in the tags,
rejected alternates between the right answer without the tags and a wrong answer (another item's) in the tags, so
the rewards below prefer every chosen one. Neither has reasoning in it; the RLVR route trains on none of them.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from rlhf.config import DataConfig, ReasoningTaskConfig
from rlhf.errors import ConfigError, first_line

PACKAGE = "reasoning-gym"
INSTALL = "`make run-rlvr TASK=<name>` installs it, or `.venv/bin/pip install -e '.[reasoning]'`"
# R1's answer format, asked for in few words: SmolLM2-135M-Instruct answered 4 of 28 held-out 1-2 digit sums right
# with it, 2 of 28 when told to show its work first (in 5x the tokens), and used the tags with neither
# (tools/reasoning_task_accuracy.py; docs/real.md). The format reward welcomes reasoning before the tags.
INSTRUCTION = "Give the final answer inside <answer> </answer> tags."
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
TAG = re.compile(r"</?answer>")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _gym() -> Any:
    """The reasoning_gym package, or a ConfigError naming the command that installs it."""
    try:
        import reasoning_gym  # optional: only for this source and its reward functions
    except ImportError:
        raise ConfigError(
            f"data.source 'reasoning_gym' needs the {PACKAGE} package, which is not installed: {INSTALL}"
        ) from None
    return reasoning_gym


def version() -> str:
    """The installed reasoning-gym's version (its distribution's: the module's __version__ lags behind)."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "not installed"


def known_tasks() -> list[str]:
    """The task names the installed reasoning-gym knows."""
    return sorted(_gym().factory.DATASETS)


def check_task(task: ReasoningTaskConfig) -> None:
    """ConfigError (one sentence) when reasoning-gym is not installed, does not know the task, or its generator
    refuses data.task.config; cheap (the generator makes one item)."""
    gym = _gym()
    if task.name not in gym.factory.DATASETS:
        raise ConfigError(
            f"data.task.name: reasoning-gym {version()} has no task '{task.name}'; it knows: {', '.join(known_tasks())}"
        )
    _dataset(task.name, json.dumps(task.config, sort_keys=True), task.train_seed, 1)


@functools.lru_cache(maxsize=32)
def _dataset(name: str, config: str, seed: int, size: int) -> Any:
    """reasoning-gym's generator of the task (`config`: its settings as JSON text, a hashable key)."""
    try:
        return _gym().create_dataset(name, seed=seed, size=size, **json.loads(config))
    except (TypeError, ValueError, AssertionError) as err:  # an unknown key, or a value its validate() refuses
        why = first_line(str(err), type(err).__name__)
        raise ConfigError(f"data.task.config: reasoning-gym's {name} generator refuses {config}: {why}") from None


def prompt_text(question: str) -> str:
    """The user turn of an item: the generator's question and the answer format asked for."""
    return f"{question.strip()}\n{INSTRUCTION}"


@dataclass(frozen=True)
class Items:
    """The generated items (reasoning-gym's dicts: question, answer, metadata), training and held-out."""

    train: list[dict[str, Any]]
    heldout: list[dict[str, Any]]


def generate(task: ReasoningTaskConfig) -> Items:
    """The training items (train_seed) and held-out items (eval_seed), each question once; held-out questions that
    are also training questions are dropped."""
    check_task(task)
    config = json.dumps(task.config, sort_keys=True)
    train = _distinct(_dataset(task.name, config, task.train_seed, task.train_size), set())
    heldout = _distinct(_dataset(task.name, config, task.eval_seed, task.eval_size), {e["question"] for e in train})
    if not heldout:
        raise ConfigError(
            f"data.task: every held-out question of {task.name} is a training question; the generator's settings "
            "leave too few distinct questions (make data.task.config harder or data.task.train_size smaller)"
        )
    assert not {e["question"] for e in train} & {e["question"] for e in heldout}  # noqa: S101 (disjoint by design)
    return Items(train, heldout)


def _distinct(dataset: Any, seen: set[str]) -> list[dict[str, Any]]:
    items = []
    for entry in dataset:
        if entry["question"] not in seen:
            seen.add(entry["question"])
            items.append(entry)
    return items


def columns(task: ReasoningTaskConfig, entry: dict[str, Any]) -> dict[str, str]:
    """An item's row columns: `answer`, and `entry` (JSON text: task, generator settings, question, metadata)."""
    rest = {"task": task.name, "config": task.config, "question": entry["question"], "metadata": entry["metadata"]}
    return {"answer": str(entry["answer"]), "entry": json.dumps(rest, default=_plain)}


def _plain(value: Any) -> Any:
    return sorted(value) if isinstance(value, set | frozenset) else str(value)


def _pair(task: ReasoningTaskConfig, entry: dict[str, Any], index: int, wrong: str) -> dict[str, Any]:
    """A conversational preference pair: the right answer in the tags against, on even items, the right answer
    without them and, on odd ones, a wrong answer in them."""
    user = {"role": "user", "content": prompt_text(entry["question"])}
    answer = str(entry["answer"])
    rejected = f"The answer is {answer}." if index % 2 == 0 else f"<answer>{wrong}</answer>"
    return {
        "chosen": [user, {"role": "assistant", "content": f"<answer>{answer}</answer>"}],
        "rejected": [user, {"role": "assistant", "content": rejected}],
        **columns(task, entry),
    }


def _pairs(task: ReasoningTaskConfig, items: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    answers = [str(e["answer"]) for e in items]
    rng = random.Random(seed)
    out = []
    for i, entry in enumerate(items):
        others = [a for a in rng.sample(answers, min(len(answers), 8)) if a != str(entry["answer"])]
        out.append(_pair(task, entry, i, others[0] if others else f"not {entry['answer']}"))
    return out


def local_source(cfg: DataConfig, folder: str | Path) -> DataConfig:
    """The task's items written as JSONL files in `folder` (training pairs, held-out pairs, PPO prompts), and the
    `local` data config that reads them (conversational, with the row columns); the rest of `cfg` is kept."""
    task, folder = cfg.task, Path(folder)
    items = generate(task)
    files = {
        "path": (folder / "reasoning-train.jsonl", _pairs(task, items.train, task.train_seed)),
        "eval_path": (folder / "reasoning-heldout.jsonl", _pairs(task, items.heldout, task.eval_seed)),
        "prompts_path": (
            folder / "reasoning-prompts.jsonl",
            [{"prompt": prompt_text(e["question"]), **columns(task, e)} for e in items.train],
        ),
    }
    for path, rows in files.values():
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    keys = {key: str(path) for key, (path, _) in files.items()}
    return DataConfig.model_validate(
        {**cfg.model_dump(), "source": "local", "format": "conversational", "columns": {}, **keys}
    )


def manifest_fields(task: ReasoningTaskConfig) -> dict[str, Any]:
    """What the prepare stage's manifest says of the source: the task, its settings and reasoning-gym's version."""
    source = f"reasoning_gym:{task.name}"
    splits = {"train": f"{source} seed {task.train_seed}", "eval": f"{source} seed {task.eval_seed}"}
    fields = {"source": source, "source_kind": "reasoning_gym", "splits": splits, "prompts_source": splits["train"]}
    return fields | {"task": task.model_dump(), "reasoning_gym": version()}


# ---- reward functions: TRL's convention, (prompts, completions, **row columns) -> one float per completion ----


def extract_answer(completion: str, answer: str) -> str | None:
    """The answer a completion gives: the text of its last non-empty ``<answer>...</answer>`` (stripped); without
    one, its last number where the task's answer is a number, else its last non-empty line; None for an empty one.
    The fallback scores what a model that has not learnt the tags answers (SmolLM2-135M never writes them at first);
    the tags are `formatted`'s reward."""
    tagged = [text.strip() for text in ANSWER.findall(completion) if text.strip()]
    if tagged:
        return tagged[-1]
    if NUMBER.fullmatch(answer.strip()):
        numbers = NUMBER.findall(completion)
        return numbers[-1] if numbers else None
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else None


def correct(prompts: list[str], completions: list[str], answer: list[str], entry: list[str], **_: Any) -> list[float]:
    """The task's own ``score_answer`` on each completion's answer (`extract_answer`): 1.0 for the right answer,
    the generator's partial credit or 0.0 otherwise (the format is `formatted`'s to judge)."""
    scores = []
    for completion, truth, text in zip(completions, answer, entry, strict=True):
        item = json.loads(text)
        dataset = _dataset(item["task"], json.dumps(item["config"], sort_keys=True), 0, 1)
        given = extract_answer(completion, truth)
        full = {"question": item["question"], "answer": truth, "metadata": item["metadata"]}
        scores.append(float(dataset.score_answer(given, full)) if given is not None else 0.0)
    return scores


def format_score(completion: str) -> float:
    """1.0 for exactly one non-empty ``<answer>...</answer>`` that ends the completion (reasoning before it is
    welcome); 0.5 for a non-empty one that text or other tags follow, or several; 0.0 without a non-empty one."""
    tagged = [m for m in ANSWER.finditer(completion) if m.group(1).strip()]
    if not tagged:
        return 0.0
    last = tagged[-1]
    alone = len(TAG.findall(completion)) == 2 and not completion[last.end() :].strip()
    return 1.0 if alone else 0.5


def formatted(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """R1's format reward: `format_score` of each completion."""
    return [format_score(completion) for completion in completions]
