"""The real tier's instruction-following prompts: IFEval's instruction types and kwargs, generated from a seed.

Each prompt is a task of some form (an email, a story, advice, a dialogue, a review, ...) about a topic, with 1 to 3
of IFEval's instructions (Zhou et al. 2023). Every IFEval type that the verifiers check offline is drawn (23 of its
25: ``length_constraints:number_sentences`` and ``change_case:capital_word_frequency`` need NLTK data no wheel
ships), with IFEval's own argument shapes: word counts both ways (``at least`` and ``less than``), exact paragraph
counts, sections, JSON, two responses, repeating the request, keyword and letter frequencies. An instruction is
stated in IFEval's words (its checker's ``build_description``) or in one of a few plain rewordings, so a policy
learns the instruction and not one sentence. Instructions IFEval's registry marks as conflicting are never drawn
together.

A row carries IFEval's ``instruction_id_list`` and ``kwargs``, so IFEval's checkers (``rlhf.data.verifiers``)
score a response against the row, not against the prompt's wording. Held-out prompts differ from training prompts
in their topic **and** their task's form: ``make_rows(n, seed, "eval")`` draws from topics and forms no training
prompt uses.

What this module adds to ``if-verifiable``: the topics, the task forms, the rewordings, the argument ranges and the
seeded draw. The preference pairs in ``data/ifeval/`` were sampled from SmolLM2-135M-Instruct on these prompts and
labelled by the checkers (``tools/sample_instruction_pairs.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from rlhf.data import verifiers

TRAIN_TOPICS = [
    "the ocean", "learning to cook", "a walk in the mountains", "why sleep matters", "the first bicycle",
    "keeping a garden", "a visit to a museum", "the night sky", "saving money", "a good teacher",
    "moving to a new city", "learning a new language", "drinking enough water", "an old library", "playing chess",
    "a busy train station", "planting a tree", "a long road trip", "taking photographs", "a friendly neighbour",
    "recycling at home", "a summer festival", "riding a horse", "baking a cake", "the first day of school",
    "exercise in the morning", "writing letters by hand", "the moon", "honey bees", "board games with family",
    "volcanoes", "public libraries", "electric cars", "learning to swim", "the history of tea", "rainforests",
    "working from home", "street food", "a job interview", "camping in the desert", "video games", "coral reefs",
    "the invention of the printing press", "owning a cat", "training for a marathon", "solar panels",
    "a thunderstorm", "visiting grandparents", "building a birdhouse", "the water cycle", "a farmers' market",
    "learning the guitar", "bird migration", "a science fair", "fixing a flat tyre", "penguins", "a city park",
    "making friends at a new school", "the life of a firefighter", "desert plants",
]  # fmt: skip
# Held-out topics: none is a training topic, nor inside one (so a held-out prompt never repeats a training prompt)
EVAL_TOPICS = [
    "a lighthouse", "a snowy forest", "a small bakery", "the sound of rain", "a quiet lake", "a lost umbrella",
    "glaciers", "a night at the theatre", "robots in hospitals", "a vegetable soup", "kites", "a mountain village",
    "the first airplane", "a pet rabbit", "ancient Egypt", "a school orchestra",
]  # fmt: skip

# A task's form: training prompts use TRAIN_FORMS, held-out prompts EVAL_FORMS (none shared)
TRAIN_FORMS = [
    "Write a short story about {topic}.",
    "Write an email to a friend about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Give some advice to someone who wants to learn about {topic}.",
    "Write a dialogue between two people talking about {topic}.",
    "Write a review of a book about {topic}.",
    "Write a blog post about {topic}.",
    "Write a poem about {topic}.",
    "Describe {topic}.",
    "Write a short essay on {topic}.",
    "List some interesting facts about {topic}.",
    "Write a speech for a school assembly about {topic}.",
    "Tell me about {topic}.",
    "Write a product description for a guidebook about {topic}.",
]
EVAL_FORMS = [
    "Write a letter to your future self about {topic}.",
    "Write a newspaper article about {topic}.",
    "Write a diary entry about {topic}.",
    "Write an advertisement for a tour about {topic}.",
    "Summarize what a beginner should know about {topic}.",
    "Write a riddle and its answer about {topic}.",
]
# the task of a prompt whose only instruction is a fixed yes/no/maybe answer: a question, as IFEval asks it
QUESTION_FORMS = {"train": "Is {topic} worth learning about?", "eval": "Would you recommend {topic} to a friend?"}

WORDS = [
    "bright", "simple", "river", "gentle", "window", "golden", "careful", "morning", "quiet", "friend", "journey",
    "history", "colour", "future", "balance", "energy", "kindness", "pattern", "season", "surprise",
]  # fmt: skip
FORBIDDEN = ["very", "really", "good", "nice", "also", "things", "important", "great", "just", "many"]
END_PHRASES = ["Is there anything else I can help with?", "That is all.", "Thank you for reading.", "The end."]
FIRST_WORDS = ["first", "today", "however", "finally", "many", "this", "imagine", "sometimes"]
LANGUAGES = ["fr", "es", "de", "it", "pt"]
SECTION_SPLITTERS = ["Section", "SECTION", "Part", "PARAGRAPH"]
# the paragraph and section counts IFEval asks for; more would not fit the tier's response budget
PARTS = (2, 3, 4)
# how often a keyword's or a letter's count is a floor ("at least") rather than a ceiling ("less than")
FLOOR_SHARE = 0.5
# A word count is drawn WORD_COUNT_WEIGHT times as often as another type, and is a floor WORD_FLOOR_SHARE of the
# time: about a third of the prompts ask for a length, mostly a floor, as IFEval's own prompts do ("at least
# 300 words"). Without it, a short answer meets most types (no commas, a postscript, an end phrase, all lowercase
# ...) and a policy trained on them learns to write less. The floors fit the tier's response budget (80 words take
# about 110 of SmolLM2's tokens).
WORD_COUNT_WEIGHT = 5
WORD_FLOOR_SHARE = 0.75
WORDS_AT_LEAST = (40, 50, 60, 80)
WORDS_LESS_THAN = (40, 60, 80, 100)


def _relation(rng: random.Random) -> str:
    return "at least" if rng.random() < FLOOR_SHARE else "less than"


def _word_count(rng: random.Random) -> dict[str, Any]:
    relation = "at least" if rng.random() < WORD_FLOOR_SHARE else "less than"
    pool = WORDS_AT_LEAST if relation == "at least" else WORDS_LESS_THAN
    return {"num_words": rng.choice(pool), "relation": relation}


def _keyword_frequency(rng: random.Random) -> dict[str, Any]:
    return {"keyword": rng.choice(WORDS), "frequency": rng.randint(2, 3), "relation": _relation(rng)}


def _letter_frequency(rng: random.Random) -> dict[str, Any]:
    if rng.random() < FLOOR_SHARE:  # a common letter, often
        return {"letter": rng.choice("aeinorst"), "let_frequency": rng.choice([5, 8, 10]), "let_relation": "at least"}
    return {"letter": rng.choice("jqxz"), "let_frequency": rng.choice([2, 3]), "let_relation": "less than"}


def _nth_paragraph(rng: random.Random) -> dict[str, Any]:
    paragraphs = rng.choice(PARTS)
    return {
        "num_paragraphs": paragraphs,
        "nth_paragraph": rng.randint(1, paragraphs),
        "first_word": rng.choice(FIRST_WORDS),
    }


# Every IFEval instruction type the verifiers check offline, each with a draw of its arguments. The request that
# combination:repeat_prompt repeats is the prompt itself (make_row fills it in).
ARGUMENTS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "keywords:existence": lambda rng: {"keywords": rng.sample(WORDS, rng.randint(1, 3))},
    "keywords:frequency": _keyword_frequency,
    "keywords:forbidden_words": lambda rng: {"forbidden_words": rng.sample(FORBIDDEN, rng.randint(2, 3))},
    "keywords:letter_frequency": _letter_frequency,
    "language:response_language": lambda rng: {"language": rng.choice(LANGUAGES)},
    "length_constraints:number_paragraphs": lambda rng: {"num_paragraphs": rng.choice(PARTS)},
    "length_constraints:number_words": _word_count,
    "length_constraints:nth_paragraph_first_word": _nth_paragraph,
    "detectable_content:number_placeholders": lambda rng: {"num_placeholders": rng.randint(1, 3)},
    "detectable_content:postscript": lambda rng: {"postscript_marker": rng.choice(["P.S.", "P.P.S"])},
    "detectable_format:number_bullet_lists": lambda rng: {"num_bullets": rng.randint(2, 5)},
    "detectable_format:constrained_response": lambda rng: {},
    "detectable_format:number_highlighted_sections": lambda rng: {"num_highlights": rng.randint(1, 3)},
    "detectable_format:multiple_sections": lambda rng: {
        "section_spliter": rng.choice(SECTION_SPLITTERS),
        "num_sections": rng.choice(PARTS),
    },
    "detectable_format:json_format": lambda rng: {},
    "detectable_format:title": lambda rng: {},
    "combination:two_responses": lambda rng: {},
    "combination:repeat_prompt": lambda rng: {},
    "startend:end_checker": lambda rng: {"end_phrase": rng.choice(END_PHRASES)},
    "change_case:english_capital": lambda rng: {},
    "change_case:english_lowercase": lambda rng: {},
    "punctuation:no_comma": lambda rng: {},
    "startend:quotation": lambda rng: {},
}
INSTRUCTION_TYPES = tuple(ARGUMENTS)

# Plain rewordings of an instruction beside IFEval's own sentence (drawn as often as it), for the types a user states
# in many ways; each is a format string over the instruction's kwargs
REWORDINGS: dict[str, list[str]] = {
    "keywords:existence": ["Make sure your answer uses these words: {keywords_list}."],
    "keywords:frequency": ["Use the word '{keyword}' {relation} {frequency} times."],
    "keywords:forbidden_words": ["Do not use any of these words: {forbidden_words_list}."],
    "length_constraints:number_words": ["Your answer should be {relation} {num_words} words long."],
    "length_constraints:number_paragraphs": [
        "Write exactly {num_paragraphs} paragraphs and put the markdown divider *** between them."
    ],
    "detectable_content:postscript": ["End with a postscript that starts with {postscript_marker}"],
    "detectable_content:number_placeholders": [
        "Include at least {num_placeholders} placeholders in square brackets, like [name]."
    ],
    "detectable_format:number_bullet_lists": [
        "Use exactly {num_bullets} markdown bullet points (lines that start with *) in your answer."
    ],
    "detectable_format:number_highlighted_sections": [
        "Highlight at least {num_highlights} parts of your answer with markdown, like *this part*."
    ],
    "detectable_format:title": ["Give your answer a title in double angular brackets, like <<my title>>."],
    "startend:end_checker": ['End your answer with the exact phrase "{end_phrase}" and nothing after it.'],
    "change_case:english_capital": ["Write your whole answer in English using only CAPITAL letters."],
    "change_case:english_lowercase": ["Write your whole answer in English using only lowercase letters."],
    "punctuation:no_comma": ["Do not use any commas in your answer."],
    "startend:quotation": ["Put your whole answer inside double quotation marks."],
    "detectable_format:json_format": ["Format your entire answer as JSON."],
}


def describe(instruction_id: str, kwargs: dict[str, Any]) -> str:
    """IFEval's own sentence for an instruction with these arguments."""
    checker = verifiers.registry("ifeval")[instruction_id](instruction_id)
    return checker.build_description(**kwargs)


def state(rng: random.Random, instruction_id: str, kwargs: dict[str, Any]) -> str:
    """The instruction as the prompt states it: IFEval's sentence or one of its rewordings, as often."""
    options = REWORDINGS.get(instruction_id, [])
    if not options or rng.random() < 0.5:
        return describe(instruction_id, kwargs)
    lists = {f"{key}_list": ", ".join(value) for key, value in kwargs.items() if isinstance(value, list)}
    return rng.choice(options).format(**kwargs, **lists)


def _compatible(candidate: str, chosen: list[str], conflicts: dict[str, set[str]]) -> bool:
    return candidate not in chosen and not any(
        candidate in conflicts.get(other, ()) or other in conflicts.get(candidate, ()) for other in chosen
    )


def make_row(rng: random.Random, topics: list[str], forms: list[str], question: str, max_instructions: int = 3):
    """One prompt: a task of one of `forms` about one of `topics` and 1 to `max_instructions` instructions that do
    not conflict, as a row with ``prompt``, ``instruction_id_list`` and ``kwargs`` (IFEval's layout)."""
    conflicts = verifiers.conflicts("ifeval")
    ids: list[str] = []
    for _ in range(rng.randint(1, max_instructions)):
        options = [i for i in INSTRUCTION_TYPES if _compatible(i, ids, conflicts)]
        if not options:
            break
        weights = [WORD_COUNT_WEIGHT if i == "length_constraints:number_words" else 1 for i in options]
        ids.append(rng.choices(options, weights)[0])
    kwargs = [ARGUMENTS[i](rng) for i in ids]
    form = question if ids == ["detectable_format:constrained_response"] else rng.choice(forms)
    task = form.format(topic=rng.choice(topics))
    sentences = {i: state(rng, i, k) for i, k in zip(ids, kwargs, strict=True) if i != "combination:repeat_prompt"}
    request = " ".join([task, *sentences.values()])
    if "combination:repeat_prompt" in ids:  # the request to repeat: the prompt without this instruction's sentence
        at = ids.index("combination:repeat_prompt")
        kwargs[at] = {"prompt_to_repeat": request}
        request = f"{request} {describe('combination:repeat_prompt', kwargs[at])}"
    return {"prompt": request, "instruction_id_list": ids, "kwargs": kwargs}


def make_rows(n: int, seed: int, split: str, max_instructions: int = 3) -> list[dict[str, Any]]:
    """`n` rows with distinct prompts of a split: 'train' (TRAIN_TOPICS and TRAIN_FORMS) or 'eval' (EVAL_TOPICS and
    EVAL_FORMS: no topic and no form of a training prompt)."""
    rng = random.Random(f"ifeval-{split}-{seed}")
    held_out = split == "eval"
    topics, forms = (EVAL_TOPICS, EVAL_FORMS) if held_out else (TRAIN_TOPICS, TRAIN_FORMS)
    question = QUESTION_FORMS["eval" if held_out else "train"]
    rows: dict[str, dict[str, Any]] = {}
    while len(rows) < n:
        row = make_row(rng, topics, forms, question, max_instructions)
        rows.setdefault(row["prompt"], row)
    return [{"key": f"{split}-{i}", **row} for i, row in enumerate(rows.values())]
