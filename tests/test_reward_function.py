"""Reward functions (rlhf/rollout/reward_function.py): loading by 'module:callable', the checked call, the errors as
one sentence naming the function and the row, and the digest that keys the cache."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rlhf.errors import ConfigError
from rlhf.rollout.reward_function import RewardFunctionError, function_digest, load_reward_function


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `user_rewards` on sys.path, rewritten by each test that needs other contents."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        (tmp_path / "user_rewards.py").write_text(textwrap.dedent(source))
        sys.modules.pop("user_rewards", None)
        return "user_rewards"

    yield write
    sys.modules.pop("user_rewards", None)


def test_a_batched_function_scores_every_pair(user_module):
    user_module(
        """
        def length(prompts, responses):
            return [len(r) - len(p) for p, r in zip(prompts, responses)]
        """
    )
    fn = load_reward_function("user_rewards:length")
    assert fn(["ab", "a"], ["abcd", "a"]) == [2.0, 0.0]  # 4 - 2; 1 - 1


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("no_colon", ["must be 'module:callable'", "no_colon"]),
        ("user_rewards:", ["must be 'module:callable'"]),
        ("not_a_module_anywhere:f", ["not_a_module_anywhere", "cannot be imported", "PYTHONPATH"]),
        ("user_rewards:missing", ["has no attribute 'missing'"]),
        ("user_rewards:CONSTANT", ["is a int, not a callable"]),
    ],
)
def test_names_that_cannot_be_used_are_config_errors_naming_the_key(user_module, spec, words):
    user_module("CONSTANT = 3\n")
    with pytest.raises(ConfigError) as err:
        load_reward_function(spec)
    assert str(err.value).startswith("reward.function")
    for word in words:
        assert word in str(err.value)


def test_a_module_that_raises_on_import_is_one_sentence(user_module):
    user_module("raise RuntimeError('needs a licence key')\n")
    with pytest.raises(ConfigError, match="cannot be imported .RuntimeError: needs a licence key"):
        load_reward_function("user_rewards:f")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("raise KeyError('answer')", r"user_rewards:f raised KeyError: 'answer' \(on a batch of 2 responses\)"),
        ("return [1.0]", r"returned 1 values for 2 responses: it must return one per response"),
        ("return 3.0", r"must return a list of numbers, one per response; it returned float"),
        ("return [1.0, 'high']", r"must return a list of numbers"),
        ("return [0.5, float('nan')]", r"returned nan for row 1 of a batch \(prompt 'q2', response 'r2'\)"),
        ("return [float('-inf'), 0.0]", r"returned -inf for row 0"),
    ],
)
def test_a_function_that_misbehaves_stops_with_one_sentence(user_module, body, message):
    user_module(f"def f(prompts, responses):\n    {body}\n")
    fn = load_reward_function("user_rewards:f")
    with pytest.raises(RewardFunctionError, match=message) as err:
        fn(["q1", "q2"], ["r1", "r2"])
    assert "\n" not in str(err.value)


def test_the_digest_follows_the_source_file_and_the_name(user_module):
    user_module("def f(prompts, responses):\n    return [1.0] * len(prompts)\ng = f\n")
    first = function_digest("user_rewards:f")
    assert function_digest("user_rewards:f") == first
    assert function_digest("user_rewards:g") != first  # another name, same file
    user_module("def f(prompts, responses):\n    return [2.0] * len(prompts)\ng = f\n")
    assert function_digest("user_rewards:f") != first  # the rule changed
