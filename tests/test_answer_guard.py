"""The verifier guard (`guard: true` on any reward or verifier) and the strict metric beside every
eval: the games a real model played on math-verify score 0, honest answers keep their score."""

import asyncio

import pytest

from rlpipe.rewards import RewardError, call_reward
from rlpipe.rewards.answer_checks import strict_match
from rlpipe.rewards.answer_guard import game

PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 77 * 7? Answer with the number only.<|im_end|>\n<|im_start|>assistant\n"
)
WORD_PROBLEM = "<|im_start|>user\nTom has 14 apples. Tom gets 15 more. How many apples does Tom have now?<|im_end|>\n"

GAMES = [
    ("To calculate 77 * 7, we need to perform the multiplication operation", "restates"),  # what RL learned
    ("What is 77 * 7? Answer with the number only.", "echoes"),  # the prompt echoed
    ("What is 77 * 7? It is 539.", "echoes"),
    ("The answer is 77 \\times 7", "expression"),  # an expression instead of a value
    ("The answer is 77 * 7.", "expression"),
    ("77 * 7 = 539. The answer is 539 +", "expression"),  # cut off mid-expression: math-verify read 539
    ("77*7", "restates"),
]
HONEST = ["539", "77 * 7 = 539", "The answer is 539.", "so it is $539$", "7 * 7 = 49, so 77 * 7 = 539"]


def _scores(entry: dict, completions: list[str], prompt: str = PROMPT) -> list[float]:
    columns = {"answer": ["539"] * len(completions)}
    return call_reward(entry, [prompt] * len(completions), completions, columns, "reward.functions", timeout_s=60)


@pytest.mark.parametrize("completion, kind", GAMES)
def test_the_guard_names_each_game(completion: str, kind: str):
    assert (game(PROMPT, completion) or "").startswith(kind)


@pytest.mark.parametrize("completion", HONEST)
def test_the_guard_lets_answers_through(completion: str):
    assert game(PROMPT, completion) is None


def test_a_guarded_verifier_scores_the_games_0_and_says_why():
    """math_equivalence alone credits the echo that states the value; a plain exact-number function,
    which a restated question beats when the answer is one of the prompt's numbers, is guarded the same way."""
    completions = [c for c, _ in GAMES] + HONEST
    plain = _scores({"type": "math_equivalence", "answer_column": "answer"}, completions)
    guarded = _scores({"type": "math_equivalence", "answer_column": "answer", "guard": True}, completions)
    assert plain[2] == 1.0  # "What is 77 * 7? It is 539." answers, by echoing
    assert guarded == [0.0] * len(GAMES) + [1.0] * len(HONEST)
    assert [reason.split(":")[1].strip() for reason in guarded.reasons[: len(GAMES)]] == [k for _, k in GAMES]
    assert guarded.reasons[len(GAMES) :] == [""] * len(HONEST)

    anything = {"type": "function", "function": "tests.test_answer_guard:contains_a_prompt_number", "guard": True}
    assert _scores(anything, ["Tom has 14 apples and gets 15 more"], WORD_PROBLEM) == [1.0]  # no expression
    assert _scores(anything, ["so 14 + 15 apples"], WORD_PROBLEM) == [0.0]  # restated
    assert _scores(anything, ["14 + 15 = 29"], WORD_PROBLEM) == [1.0]
    asynchronous = anything | {"function": "tests.test_answer_guard:async_contains_a_prompt_number"}
    assert _scores(asynchronous, ["so 14 + 15 apples", "14 + 15 = 29"], WORD_PROBLEM) == [0.0, 1.0]
    with pytest.raises(RewardError, match="guard must be true or false"):
        _scores({"type": "math_equivalence", "guard": "yes"}, ["539"])


def contains_a_prompt_number(prompts: list[str], completions: list[str], **_) -> list[float]:
    return [float("14" in c or "15" in c) for c in completions]


async def async_contains_a_prompt_number(prompts: list[str], completions: list[str], **_) -> list[float]:
    await asyncio.sleep(0)
    return contains_a_prompt_number(prompts, completions)


@pytest.mark.parametrize(
    "completion, reference, strict",
    [
        ("539", "539", True),
        ("77 * 7 = 539", "539", True),
        ("so he now has 14 + 15 = 29 apples.", "29", True),  # units after the value
        ("The answer is 539.", "539", True),
        ("To calculate 77 * 7, we need to perform the multiplication operation", "539", False),
        ("The answer is 77 * 7", "539", False),
        ("The answer is 539 +", "539", False),
        ("539.0", "539", False),  # equal in value, not in text: math_equivalence's business
        ("\\frac{1}{2}", "0.5", False),
        ("", "539", False),
    ],
)
def test_the_strict_metric_compares_text_not_value(completion: str, reference: str, strict: bool):
    assert strict_match(completion, reference) is strict
