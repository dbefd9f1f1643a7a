"""The field's verifiers (rlhf/data/verifiers.py): IFEval's and IFBench's checkers offline, on hand-checked responses,
strict and loose; a row's ids and kwargs checked with one sentence naming the row; the benchmark's figures by hand
(rlhf/eval/benchmark.py); and the generated IFEval-style prompts (rlhf/data/instructions.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

from rlhf.data import instructions, verifiers
from rlhf.errors import DataError
from rlhf.eval import benchmark
from tests.conftest import REPO

IFBENCH_FILE = REPO / "data" / "ifbench" / "IFBench_test.jsonl"


def test_the_checkers_import_and_score_with_no_network_and_no_download():
    """IFBench's module calls nltk.download at import: here every socket and every download raises, and both
    registries still import and score."""
    script = textwrap.dedent(
        """
        import socket
        import nltk

        def refuse(*args, **kwargs):
            raise RuntimeError("network used")

        socket.socket.connect = refuse
        socket.create_connection = refuse
        nltk.download = refuse
        from rlhf.data import verifiers

        assert len(verifiers.registry("ifeval")) == 25 and len(verifiers.registry("ifbench")) >= 57
        print(verifiers.ifeval_strict(["p"], ["No commas here."], [["punctuation:no_comma"]], [[{}]]))
        print(verifiers.ifbench_strict(["p"], ["abc"], [["format:no_whitespace"]], [[{}]]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[1.0]", "[1.0]"]


@pytest.mark.parametrize(
    ("instruction_id", "kwargs", "response", "strict", "loose"),
    [
        ("punctuation:no_comma", {}, "No commas here.", True, True),
        ("punctuation:no_comma", {}, "Well, yes.", False, False),
        ("change_case:english_lowercase", {}, "the sea is calm today.", True, True),
        ("change_case:english_lowercase", {}, "The sea is calm today.", False, False),
        ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two", True, True),
        (
            "detectable_format:number_bullet_lists",
            {"num_bullets": 2},
            "* one\n* two\n* three",
            False,
            True,
        ),  # loose: no last line
        ("startend:end_checker", {"end_phrase": "The end."}, "It was fun. The end.", True, True),
        ("startend:end_checker", {"end_phrase": "The end."}, "The end. It was fun.", False, False),
        # the loose criterion drops the last line: a note after the end phrase passes loosely only
        ("startend:end_checker", {"end_phrase": "The end."}, "It was fun. The end.\nNote: short.", False, True),
        # ... and the markdown asterisks: a bold quotation passes loosely only
        ("startend:quotation", {}, '**"All of it."**', False, True),
        ("detectable_format:title", {}, "<<Bees>>\nBees hum.", True, True),
        ("detectable_format:title", {}, "Bees hum.", False, False),
        (
            "length_constraints:number_words",
            {"num_words": 5, "relation": "less than"},
            "one two three four",
            True,
            True,
        ),
        (
            "length_constraints:number_words",
            {"num_words": 5, "relation": "less than"},
            "one two three four five",
            False,
            False,
        ),
        ("keywords:existence", {"keywords": ["river"]}, "The sea is calm.", False, False),
        ("keywords:existence", {"keywords": ["river"]}, "A River runs by.", True, True),  # case does not matter
        ("punctuation:no_comma", {}, "", False, False),  # an empty answer follows nothing
    ],
)
def test_ifeval_checkers_on_hand_checked_responses(instruction_id, kwargs, response, strict, loose):
    scored = verifiers.score("prompt", response, [instruction_id], [kwargs], "ifeval")
    assert (scored.strict, scored.loose) == ([strict], [loose])


@pytest.mark.parametrize(
    ("instruction_id", "kwargs", "response", "strict"),
    [
        ("format:no_whitespace", {}, "abc", True),
        ("format:no_whitespace", {}, "a b", False),
        ("count:word_count_range", {"min_words": 71.0, "max_words": 73.0}, " ".join(["word"] * 72), True),
        ("count:word_count_range", {"min_words": 71.0, "max_words": 73.0}, " ".join(["word"] * 10), False),
        (
            "count:keywords_multiple",
            dict(
                keyword1="kaleidoscope", keyword2="nebula", keyword3="whisper", keyword4="labyrinth", keyword5="paradox"
            ),
            " ".join(["kaleidoscope"] + ["nebula"] * 2 + ["whisper"] * 3 + ["labyrinth"] * 5 + ["paradox"] * 7),
            True,
        ),
        (
            "count:keywords_multiple",
            dict(
                keyword1="kaleidoscope", keyword2="nebula", keyword3="whisper", keyword4="labyrinth", keyword5="paradox"
            ),
            "kaleidoscope",
            False,
        ),
    ],
)
def test_ifbench_checkers_on_hand_checked_responses(instruction_id, kwargs, response, strict):
    assert verifiers.score("prompt", response, [instruction_id], [kwargs], "ifbench").strict == [strict]


def test_an_instruction_whose_checker_needs_missing_nltk_data_is_not_scored():
    import nltk

    try:
        nltk.data.find("tokenizers/punkt")
        installed = True
    except LookupError:
        installed = False
    ids = ["length_constraints:number_sentences", "punctuation:no_comma"]
    scored = verifiers.score("p", "One. Two.", ids, [{"num_sentences": 3, "relation": "less than"}, {}], "ifeval")
    if installed:
        assert scored.strict == [True, True] and scored.unscorable == 0
    else:  # left out of the share, counted
        assert scored.strict == [None, True] and scored.unscorable == 1 and scored.share() == 1.0


def test_the_reward_is_the_share_of_a_rows_instructions_followed():
    ids = [["punctuation:no_comma", "change_case:english_lowercase"]] * 3
    kwargs = [[{}, {}]] * 3
    lines = ["the bees hum in the warm garden all day long.", "The bees hum in the warm garden all day long."]
    responses = [*lines, "The bees, they hum in the warm garden all day long."]
    assert verifiers.ifeval_strict(["p"] * 3, responses, ids, kwargs) == [1.0, 0.5, 0.0]


@pytest.mark.parametrize(
    ("ids", "kwargs", "words"),
    [
        (["punctuation:no_comas"], [{}], ["row 3 of f.jsonl", "unknown ifeval instruction id 'punctuation:no_comas'"]),
        (["punctuation:no_comma"], [{}, {}], ["row 3 of f.jsonl", "one dict per instruction (1)"]),
        ([], [], ["row 3 of f.jsonl", "non-empty list"]),
        (
            ["length_constraints:number_words"],
            [{"num_word": 5, "relation": "less than"}],
            ["row 3 of f.jsonl", "takes no argument 'num_word'", "num_words"],
        ),
        (
            ["length_constraints:number_words"],
            [{"num_words": 5, "relation": "fewer"}],
            ["row 3 of f.jsonl", "refuses its kwargs"],
        ),
    ],
)
def test_a_bad_row_is_one_sentence_naming_it(ids, kwargs, words):
    with pytest.raises(DataError) as err:
        verifiers.check_row(ids, kwargs, "ifeval", "row 3 of f.jsonl")
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_the_benchmark_figures_by_hand():
    """Three prompts, SFT and trained. Prompt-level: every instruction followed; instruction-level: the share."""
    rows = benchmark.BenchmarkRows(
        "toy",
        "ifeval",
        "toy.jsonl",
        ["a", "b", "c"],
        ["p"] * 3,
        [
            ["punctuation:no_comma", "change_case:english_lowercase"],
            ["punctuation:no_comma"],
            ["detectable_format:title"],
        ],
        [[{}, {}], [{}], [{}]],
    )
    sft = benchmark.score_rows(rows, ["Bees, hum.", "No commas.", "no title"])  # 0 of 2, 1 of 1, 0 of 1
    answer = "the bees hum in the warm garden all day long."
    trained = benchmark.score_rows(rows, [answer, "Well, no.", "<<T>> yes"])  # 2 of 2, 0 of 1, 1 of 1
    figures = benchmark.figures({"sft": sft, "policy": trained})
    assert figures["n_prompts"] == 3 and figures["n_instructions"] == 4
    assert figures["sft/prompt_strict"] == pytest.approx(1 / 3)  # prompt b only
    assert figures["sft/instruction_strict"] == pytest.approx(1 / 4)
    assert figures["policy/prompt_strict"] == pytest.approx(2 / 3)  # a and c
    assert figures["policy/instruction_strict"] == pytest.approx(3 / 4)
    assert figures["gain/instruction_strict"] == pytest.approx(0.5)
    assert figures["gain/instruction_strict_lo"] <= 0.5 <= figures["gain/instruction_strict_hi"]
    table = benchmark.by_type({"sft": sft, "policy": trained}).set_index("instruction_id")
    assert table.loc["punctuation:no_comma", "prompts"] == 2
    assert (
        table.loc["punctuation:no_comma", "sft_strict"] == 0.5
        and table.loc["punctuation:no_comma", "policy_strict"] == 0.5
    )
    assert table.loc["detectable_format:title", "change_points"] == pytest.approx(100.0)
    metrics = benchmark.metrics("toy", figures, benchmark.by_type({"sft": sft, "policy": trained}))
    assert metrics["benchmark/toy/type/detectable_format.title/policy_strict"] == 1.0
    lines = benchmark.report_lines(metrics, "toy")
    assert lines[0] == "toy: 3 prompts, 4 instructions (95% intervals)"
    assert "instruction-level strict: SFT 25.0%" in lines[3] and "+50.0 points" in lines[3]
    table_md = benchmark.markdown_table(metrics, "toy", "GRPO").splitlines()
    assert table_md[0] == "| toy (3 prompts, 4 instructions) | SFT | GRPO | gain (points) |"
    assert table_md[4].startswith("| instruction-level strict | 25.0% [") and "| +50.0 [" in table_md[4]
    read_back = benchmark.type_table(metrics, "toy").set_index("instruction_id")
    assert read_back.loc["detectable_format:title", "policy_strict"] == 1.0


def test_a_benchmark_file_is_checked_line_by_line(tmp_path):
    missing = tmp_path / "IFBench_test.jsonl"
    with pytest.raises(DataError, match="does not exist; `make real-model` installs IFBench's test set"):
        benchmark.read_benchmark("ifbench", missing, "ifbench", None)
    good = {"key": "1", "prompt": "p", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    bad = {**good, "instruction_id_list": ["punctuation:none"]}
    missing.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"IFBench_test.jsonl line 2: unknown ifeval instruction id 'punctuation:none'"):
        benchmark.read_benchmark("x", missing, "ifeval", None)
    assert benchmark.read_benchmark("x", missing, "ifeval", 1).keys == ["1"]  # the first N rows only


@pytest.mark.skipif(not IFBENCH_FILE.is_file(), reason="IFBench's test set is not installed (make real-model)")
def test_ifbenchs_test_set_reads_and_checks_with_the_registry():
    rows = benchmark.read_benchmark("ifbench", IFBENCH_FILE, "ifbench", None)
    assert len(rows.prompts) == 294
    assert len({i for ids in rows.instruction_ids for i in ids}) >= 57


def test_generated_prompts_are_deterministic_disjoint_and_never_combine_conflicting_instructions():
    train = instructions.make_rows(600, seed=0, split="train")
    assert train == instructions.make_rows(600, seed=0, split="train")
    assert len({r["prompt"] for r in train}) == 600
    heldout = instructions.make_rows(160, seed=0, split="eval")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    for topic in instructions.EVAL_TOPICS:  # no held-out topic in a training prompt
        assert not any(topic in r["prompt"] for r in train)
    for form in instructions.EVAL_FORMS:  # nor a held-out task's form
        lead = form.split("{topic}")[0]
        assert not any(r["prompt"].startswith(lead) for r in train)
    for form in instructions.TRAIN_FORMS:  # and no held-out prompt has a training form
        lead = form.split("{topic}")[0]
        assert not any(r["prompt"].startswith(lead) for r in heldout)
    conflicts = verifiers.conflicts("ifeval")
    for row in train + heldout:
        ids = row["instruction_id_list"]
        verifiers.check_row(ids, row["kwargs"], "ifeval", row["key"])  # the registry takes every row
        assert not any(b in conflicts.get(a, ()) for a in ids for b in ids if a != b)
    assert {len(r["instruction_id_list"]) for r in train} == {1, 2, 3}
    # every IFEval type the checkers score offline, in training and held out
    scorable = set(verifiers.registry("ifeval")) - {
        "length_constraints:number_sentences",
        "change_case:capital_word_frequency",
    }
    assert {i for r in train for i in r["instruction_id_list"]} == scorable == set(instructions.INSTRUCTION_TYPES)
    assert {i for r in heldout for i in r["instruction_id_list"]} == scorable
    relations = {
        (i, k.get("relation") or k.get("let_relation"))
        for r in train
        for i, k in zip(r["instruction_id_list"], r["kwargs"], strict=True)
    }
    for counted in ("length_constraints:number_words", "keywords:frequency", "keywords:letter_frequency"):
        assert {(counted, "at least"), (counted, "less than")} <= relations  # word counts both ways


LANGUAGE_TEXT = {
    "fr": "Le soleil brille sur la mer et les enfants jouent sur la plage avec leurs amis pendant tout l'été.",
    "es": "El sol brilla sobre el mar y los niños juegan en la playa con sus amigos durante todo el verano.",
    "de": "Die Sonne scheint über dem Meer und die Kinder spielen den ganzen Sommer mit ihren Freunden am Strand.",
    "it": "Il sole splende sul mare e i bambini giocano sulla spiaggia con i loro amici per tutta l'estate.",
    "pt": "O sol brilha sobre o mar e as crianças brincam na praia com os seus amigos durante todo o verão.",
}
PLAIN = "The sun shines over the sea and the children play on the beach all summer long."


def _words(n: int) -> str:
    return " ".join(["sun"] * n)


def _at_least(kw: dict) -> bool:
    return (kw.get("relation") or kw.get("let_relation")) == "at least"


def _either_way(kw: dict, many: str, few: str) -> tuple[str, str]:
    """(follows, breaks) of a count: `many` follows a floor ("at least"), `few` a ceiling ("less than")."""
    return (many, few) if _at_least(kw) else (few, many)


def _without(letter: str) -> str:
    return "".join(c for c in "bees hum softly by the sunny wall" if c != letter)


def _nth_paragraph(kw: dict) -> tuple[str, str]:
    n, nth, first = kw["num_paragraphs"], kw["nth_paragraph"], kw["first_word"]
    good = [f"{first.capitalize()} {PLAIN}" if i == nth - 1 else PLAIN for i in range(n)]
    return "\n\n".join(good), "\n\n".join([f"Xylophones {PLAIN}"] * n)


def _bullets(n: int) -> str:
    return "\n".join(f"* point {i}" for i in range(n))


# instruction type -> kwargs -> (a response that follows it, one that breaks it), written by hand
HAND_WRITTEN = {
    "keywords:existence": lambda kw: (f"{PLAIN} {' '.join(kw['keywords'])}.", PLAIN),
    "keywords:frequency": lambda kw: _either_way(kw, f"{PLAIN} {' '.join([kw['keyword']] * kw['frequency'])}", PLAIN),
    "keywords:forbidden_words": lambda kw: ("Bees hum softly.", f"Bees hum {kw['forbidden_words'][0]} softly."),
    "keywords:letter_frequency": lambda kw: _either_way(
        kw, f"{_without(kw['letter'])} {kw['letter'] * kw['let_frequency']}", _without(kw["letter"])
    ),
    "language:response_language": lambda kw: (LANGUAGE_TEXT[kw["language"]], PLAIN),
    "length_constraints:number_paragraphs": lambda kw: (
        "\n***\n".join([PLAIN] * kw["num_paragraphs"]),
        "\n***\n".join([PLAIN] * (kw["num_paragraphs"] + 1)),
    ),
    "length_constraints:number_words": lambda kw: _either_way(
        kw, _words(kw["num_words"] + 5), _words(kw["num_words"] - 5)
    ),
    "length_constraints:nth_paragraph_first_word": _nth_paragraph,
    "detectable_content:number_placeholders": lambda kw: (
        f"{PLAIN} " + " ".join(f"[slot{i}]" for i in range(kw["num_placeholders"])),
        PLAIN,
    ),
    "detectable_content:postscript": lambda kw: (f"{PLAIN}\n{kw['postscript_marker']} See you soon.", PLAIN),
    "detectable_format:number_bullet_lists": lambda kw: (_bullets(kw["num_bullets"]), _bullets(kw["num_bullets"] + 1)),
    "detectable_format:constrained_response": lambda kw: ("My answer is yes.", "Yes, of course."),
    "detectable_format:number_highlighted_sections": lambda kw: (
        " ".join(f"*part {i}*" for i in range(kw["num_highlights"])) + f" {PLAIN}",
        PLAIN,
    ),
    "detectable_format:multiple_sections": lambda kw: (
        "\n".join(f"{kw['section_spliter']} {i + 1}\n{PLAIN}" for i in range(kw["num_sections"])),
        PLAIN,
    ),
    "detectable_format:json_format": lambda kw: ('{"answer": "bees hum"}', PLAIN),
    "detectable_format:title": lambda kw: (f"<<Summer>>\n{PLAIN}", PLAIN),
    "combination:two_responses": lambda kw: (f"{PLAIN}\n******\nBees hum softly in the garden.", PLAIN),
    "combination:repeat_prompt": lambda kw: (f"{kw['prompt_to_repeat']} {PLAIN}", PLAIN),
    "startend:end_checker": lambda kw: (f"{PLAIN} {kw['end_phrase']}", PLAIN),
    "change_case:english_capital": lambda kw: (PLAIN.upper(), PLAIN),
    "change_case:english_lowercase": lambda kw: (PLAIN.lower(), PLAIN),
    "punctuation:no_comma": lambda kw: (PLAIN, "Bees, birds and ants."),
    "startend:quotation": lambda kw: (f'"{PLAIN}"', PLAIN),
}


def test_every_generated_instruction_is_followed_and_broken_as_its_checker_says():
    """For each instruction of 400 generated rows (every type, both relations of the counted ones), a response
    written to follow it passes IFEval's checker and one written to break it fails: the prompts' arguments are
    ones a response can meet, and the checker reads them as the prompt states them."""
    rows = instructions.make_rows(300, seed=3, split="train") + instructions.make_rows(100, seed=3, split="eval")
    seen = set()
    for row in rows:
        for instruction_id, kw in zip(row["instruction_id_list"], row["kwargs"], strict=True):
            follows, breaks = HAND_WRITTEN[instruction_id](kw)
            verdict = verifiers.score(row["prompt"], follows, [instruction_id], [kw], "ifeval")
            assert verdict.strict == [True], (instruction_id, kw, follows)
            verdict = verifiers.score(row["prompt"], breaks, [instruction_id], [kw], "ifeval")
            assert verdict.strict == [False], (instruction_id, kw, breaks)
            seen.add((instruction_id, kw.get("relation") or kw.get("let_relation")))
    assert {i for i, _ in seen} == set(instructions.INSTRUCTION_TYPES)
    assert ("length_constraints:number_words", "at least") in seen and ("keywords:frequency", "less than") in seen


def test_a_rows_instruction_types_are_its_categories():
    """ifeval_strict sorts its rows by instruction type: the PPO stage's group/zero_std_fraction/<type>."""
    from rlhf.rollout.reward_function import load_reward_function

    fn = load_reward_function("rlhf.data.verifiers:ifeval_strict")
    assert fn.has_categories and not load_reward_function("rlhf.data.synthetic:gold_reward").has_categories
    ids = [["punctuation:no_comma", "detectable_format:title"], ["startend:quotation"]]
    assert verifiers.instruction_types(ids, kwargs=[[{}, {}], [{}]]) == ids


def test_the_shipped_data_is_labelled_by_the_checkers():
    pairs = pd.read_json(REPO / "data" / "ifeval" / "eval.jsonl.gz", lines=True)
    assert len(pairs) >= 60
    heldout = pd.read_json(REPO / "data" / "ifeval" / "heldout.jsonl", lines=True)
    assert set(pairs["prompt"]) <= set(heldout["prompt"])

    def share(row, side):
        return verifiers.ifeval_strict(
            [row.prompt], [getattr(row, side)[-1]["content"]], [row.instruction_id_list], [row.kwargs]
        )[0]

    assert all(share(r, "chosen") > share(r, "rejected") for r in pairs.itertuples())  # held-out labels: the checkers'
    train = pd.read_json(REPO / "data" / "ifeval" / "train.jsonl.gz", lines=True)
    prompts = pd.read_json(REPO / "data" / "ifeval" / "prompts.jsonl.gz", lines=True)
    assert set(train["prompt"]) <= set(prompts["prompt"]) and not set(prompts["prompt"]) & set(heldout["prompt"])


def test_partial_credit_grades_what_is_not_followed_and_a_pass_scores_more():
    """rlhf.data.partial_credit: 1 where IFEval's strict checker passes; below PARTIAL, by how far the response got,
    where it does not (hand-checked values); the hand-written responses of every generated type: a pass 1, a
    break at most PARTIAL."""
    from rlhf.data.partial_credit import PARTIAL, ifeval_partial, instruction_credit

    def credit(response: str, instruction_id: str, **kw) -> float:
        return instruction_credit("p", response, [instruction_id], [kw])

    assert credit("hello there", "change_case:english_lowercase") == 1.0
    assert credit("Hello There", "change_case:english_lowercase") == pytest.approx(0.5 * 8 / 10)  # 8 of 10 letters
    assert credit('"hello', "startend:quotation") == 0.25  # the opening quote, not the closing one
    request = "Write a poem about cats. Use no commas."
    assert credit("Write a poem about cats. Sure", "combination:repeat_prompt", prompt_to_repeat=request) == 0.5 * 5 / 8
    assert credit("one two three", "length_constraints:number_words", num_words=6, relation="at least") == 0.25
    assert credit("one two three", "length_constraints:number_words", num_words=2, relation="less than") == 0.0
    assert credit("a\n***\nb", "length_constraints:number_paragraphs", num_paragraphs=4) == 0.25  # 2 of 4
    nth = {"num_paragraphs": 3, "nth_paragraph": 1, "first_word": "first"}
    assert credit("First a\n\nb", "length_constraints:nth_paragraph_first_word", **nth) == 0.25  # the word, not 3
    assert credit("Bees, yes.", "punctuation:no_comma") == 0.0  # a type without a graded progress
    rows = instructions.make_rows(200, seed=5, split="train")
    for row in rows:
        for instruction_id, kw in zip(row["instruction_id_list"], row["kwargs"], strict=True):
            follows, breaks = HAND_WRITTEN[instruction_id](kw)
            assert ifeval_partial([row["prompt"]], [follows], [[instruction_id]], [[kw]]) == [1.0]
            assert ifeval_partial([row["prompt"]], [breaks], [[instruction_id]], [[kw]])[0] <= PARTIAL
    # a row's score is the mean over its instructions
    both = ifeval_partial(["p"], ["hello there"], [["change_case:english_lowercase", "startend:quotation"]], [[{}, {}]])
    assert both == [pytest.approx((1.0 + 0.0) / 2)]
