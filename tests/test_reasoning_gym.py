"""The reasoning-gym source (rlhf/data/reasoning_gym.py, data.source: reasoning_gym): its two rewards against
hand-checked answers, its items (deterministic per seed, training and held-out disjoint), the prepare stage on a
few items, and its bad input, one sentence each (exit code 2 through `rlhf run`, before anything loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from rlhf.config import DataConfig, ReasoningTaskConfig
from rlhf.data import reasoning_gym as rg
from rlhf.data.prepare import prepare_preferences
from rlhf.data.source_checks import check_source, source_fingerprint
from rlhf.errors import ConfigError
from rlhf.rollout.rows import PromptRows, RowColumns

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (`pip install -e '.[reasoning]'`)")

REPO = Path(__file__).resolve().parent.parent
SUMS = ReasoningTaskConfig(
    name="chain_sum", config={"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}, train_size=40
)


def _truth(task: ReasoningTaskConfig, question: str, answer: str) -> tuple[list[str], list[str]]:
    """The row columns of one hand-written item (answer, entry), as a batch of one."""
    cols = rg.columns(task, {"question": question, "answer": answer, "metadata": {}})
    return [cols["answer"]], [cols["entry"]]


def correct(completion: str, task: ReasoningTaskConfig = SUMS, question: str = "84 - 12 =", answer: str = "72"):
    return rg.correct(["q"], [completion], *_truth(task, question, answer))[0]


@pytest.mark.parametrize(
    ("completion", "right", "form"),
    [
        ("84 - 12 = 72.\n<answer>72</answer>", 1.0, 1.0),  # reasoning, then the answer alone in the tags
        ("<answer> 72 </answer>\n\n", 1.0, 1.0),  # whitespace inside the tags and after them
        ("<answer>71</answer>", 0.0, 1.0),  # well formed, wrong
        ("<answer>+072.0</answer>", 1.0, 1.0),  # chain_sum's score_answer reads numbers: sign, zeros, decimals
        ("<answer>1072</answer>", 0.5, 1.0),  # reasoning-gym's partial credit: "72" in "1072", 2/4 characters
        ("84 minus 12 is 72.", 1.0, 0.0),  # no tags: the last number (a numeric task), but no format reward
        ("It is 72, or maybe 60.", 0.0, 0.0),  # no tags: the last number is the answer given
        ("<answer>72", 1.0, 0.0),  # an unclosed tag is no format; the last number still counts
        ("<answer></answer> 72", 1.0, 0.0),  # empty tags: not an answer; the text's last number is
        ("<answer>72</answer> Hope this helps!", 1.0, 0.5),  # text after the answer
        ("<answer>60</answer><answer>72</answer>", 1.0, 0.5),  # two answers: the last one is scored
        ("<answer>72</answer></answer>", 1.0, 0.5),  # a stray tag
        ("", 0.0, 0.0),
    ],
)
def test_rewards_against_hand_checked_answers(completion, right, form):
    assert correct(completion) == right
    assert rg.formatted(["q"], [completion]) == [form]


def test_a_task_whose_answer_is_not_a_number_falls_back_to_the_last_line():
    task = ReasoningTaskConfig(name="fraction_simplification", train_size=8, eval_size=8)
    item = rg.generate(task).train[0]  # its score_answer reads the item's metadata
    cols = rg.columns(task, item)

    def score(completion: str) -> float:
        return rg.correct(["q"], [completion], [cols["answer"]], [cols["entry"]])[0]

    assert not rg.NUMBER.fullmatch(item["answer"]) and score(f"<answer>{item['answer']}</answer>") == 1.0
    assert score(f"Divide both by their GCD.\n{item['answer']}") == 1.0  # the last line
    assert score(f"It is {item['answer']}.\nDone") == 0.01  # the last line is "Done": the task's floor, 0.01


def test_items_are_the_same_for_a_seed_and_disjoint_between_training_and_held_out():
    first, again = rg.generate(SUMS), rg.generate(SUMS.model_copy(update={}))
    assert first == again
    other = rg.generate(SUMS.model_copy(update={"train_seed": 100}))
    assert [e["question"] for e in other.train] != [e["question"] for e in first.train]
    train = [e["question"] for e in first.train]
    held = [e["question"] for e in first.heldout]
    assert len(set(train)) == len(train) and len(set(held)) == len(held) and not set(train) & set(held)
    assert all(correct(f"<answer>{e['answer']}</answer>", SUMS, e["question"], e["answer"]) for e in first.heldout)


def test_a_tiny_question_space_drops_held_out_duplicates_of_training_questions():
    tiny = ReasoningTaskConfig(name="chain_sum", config={"max_terms": 2, "max_digits": 1}, train_size=400)
    items = rg.generate(tiny)  # 1-digit sums: 200 questions, nearly all drawn by 400 training items
    assert len(items.heldout) < tiny.eval_size
    assert not {e["question"] for e in items.train} & {e["question"] for e in items.heldout}


def test_overlapping_seed_ranges_are_refused():
    with pytest.raises(ValueError, match="data.task.eval_seed: reasoning-gym draws item i from seed \\+ i"):
        DataConfig(source="reasoning_gym", task={"train_seed": 0, "train_size": 100, "eval_seed": 50})


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ConfigError, match="data.task.name: reasoning-gym .* has no task 'sums'; it knows: ") as err:
        check_source(DataConfig(source="reasoning_gym", task={"name": "sums"}))
    assert "chain_sum" in str(err.value) and "basic_arithmetic" in str(err.value) and "\n" not in str(err.value)


def test_settings_the_generator_refuses_are_one_sentence():
    with pytest.raises(ConfigError, match="data.task.config: reasoning-gym's chain_sum generator refuses"):
        check_source(DataConfig(source="reasoning_gym", task={"config": {"max_terms": 0}}))
    with pytest.raises(ConfigError, match="data.task.config"):
        check_source(DataConfig(source="reasoning_gym", task={"config": {"terms": 2}}))


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package.*make run-rlvr TASK=.*\[reasoning\]"):
        check_source(DataConfig(source="reasoning_gym"))


def test_files_and_other_sources_keys_are_refused():
    with pytest.raises(ValueError, match="data.path names a file"):
        DataConfig(source="reasoning_gym", path="x.jsonl")
    with pytest.raises(ValueError, match="data.row_columns of data.source 'reasoning_gym' are answer, entry"):
        DataConfig(source="reasoning_gym", row_columns=["answer"])


def test_prepare_writes_prompts_and_pairs_with_their_truth(tmp_path):
    cfg = DataConfig(source="reasoning_gym", task=SUMS.model_dump(), gold_reward="rlhf.data.reasoning_gym:correct")
    prepared = prepare_preferences(cfg, tmp_path / "data")
    manifest = prepared.manifest
    assert manifest["source"] == "reasoning_gym:chain_sum" and manifest["reasoning_gym"] == rg.version()
    assert manifest["task"]["train_seed"] == 0 and manifest["splits"]["eval"] == "reasoning_gym:chain_sum seed 1000000"
    prompts, held = pd.read_parquet(prepared.prompts), pd.read_parquet(prepared.eval)
    items = rg.generate(SUMS)
    assert len(prompts) == len(items.train) and held["prompt"].nunique() == len(items.heldout)
    assert all(rg.INSTRUCTION in p for p in prompts["prompt"])
    assert not set(prompts["prompt"]) & set(held["prompt"])
    columns = RowColumns.read(prepared.eval, prepared.prompts)
    values = columns.values(PromptRows.read(prepared.prompts).keys[:3], ["answer", "entry"])
    first = items.train[0]
    assert values["answer"][0] == first["answer"] and json.loads(values["entry"][0])["question"] == first["question"]
    # the chosen responses score 1 on both rewards, the rejected ones less on their sum
    got = rg.correct(list(held["prompt"]), list(held["chosen"]), **_held_columns(columns, prepared.eval))
    assert got == [1.0] * len(held) and rg.formatted([], list(held["chosen"])) == [1.0] * len(held)
    rejected = [
        c + 0.2 * f
        for c, f in zip(
            rg.correct([], list(held["rejected"]), **_held_columns(columns, prepared.eval)),
            rg.formatted([], list(held["rejected"])),
            strict=True,
        )
    ]
    assert max(rejected) < 1.2
    assert source_fingerprint(cfg) != source_fingerprint(cfg.model_copy(update={"source": "hub"}))


def _held_columns(columns: RowColumns, held: Path) -> dict[str, list]:
    return columns.values(PromptRows.read(held).keys, ["answer", "entry"])


@pytest.mark.parametrize("case", ["unknown task", "not installed"])
def test_rlhf_run_exits_2_with_one_sentence_before_anything_loads(tmp_path, case):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    overrides = ["data.source=reasoning_gym", f"runtime.output_dir={tmp_path / 'outputs'}"]
    if case == "unknown task":
        overrides.append("data.task.name=sums")
    else:  # a reasoning_gym that fails to import, first on the path
        (tmp_path / "reasoning_gym").mkdir()
        (tmp_path / "reasoning_gym" / "__init__.py").write_text("raise ImportError('No module named reasoning_gym')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", "conf/smoke.yaml", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    expected = "has no task 'sums'; it knows: " if case == "unknown task" else "make run-rlvr TASK="
    assert expected in lines[0]
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").iterdir())
