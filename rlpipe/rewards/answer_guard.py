"""A guard against the ways an RL policy satisfies a verifier without answering, for any reward
function or verifier: `{type: math_equivalence, answer_column: answer, guard: true}` (or
`{type: function, function: 'module:fn', guard: true}`) scores 0 every completion that

  echoes     repeats the prompt's question (a sentence of it ending in '?', of 4+ words) or
             ECHO_WORDS consecutive words of the prompt;
  expression gives as its final answer (math_equivalence's rule) arithmetic left unevaluated ("77*7");
  restates   writes arithmetic over the prompt's numbers ("To calculate 77 * 7, we ...") and never a
             result of it ("= 539").

A real model found the third in ten iterations: math-verify parses "To calculate 77 * 7, we need
to ..." as 77*7 and sympy accepts it for 539. The guard's reason is recorded with the score.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from rlpipe.rewards.answer_checks import NUMBER, answer_text, final_answer
from rlpipe.rewards.registry import RewardFunction, Rewards

ECHO_WORDS = 12
WORD = re.compile(r"[A-Za-z0-9]+")
QUESTION = re.compile(r"[^.?!\n>]*\?")
EXPRESSION = re.compile(rf"({NUMBER})\s*(?:[-+*/^×÷]|\\times|\\cdot|\\div)\s*({NUMBER})")
RESULT = re.compile(rf"=\s*\$?\s*{NUMBER}")


def game(prompt: str, completion: str) -> str | None:
    """Why `completion` games the verifier for `prompt` (echoes, expression, restates), or None."""
    said = " ".join(WORD.findall(completion.lower()))
    for question in QUESTION.findall(prompt):
        words = WORD.findall(question.lower())
        if len(words) >= 4 and " ".join(words) in said:
            return "echoes: repeats the prompt's question"
    run = longest_common_run(WORD.findall(prompt.lower()), said.split())
    if run >= ECHO_WORDS:
        return f"echoes: repeats {run} consecutive words of the prompt"
    answer = answer_text(completion)
    if answer is not None and final_answer(completion) is None:  # refused only as unevaluated arithmetic
        return f"expression: the answer {answer!r} is arithmetic left unevaluated"
    prompt_numbers = set(re.findall(NUMBER, prompt))
    restated = [m.group(0) for m in EXPRESSION.finditer(completion) if {m.group(1), m.group(2)} <= prompt_numbers]
    if restated and not RESULT.search(completion):
        return f"restates: {restated[0]!r} from the prompt without a result"
    return None


def longest_common_run(a: list[str], b: list[str]) -> int:
    """The length of the longest run of consecutive words that `a` and `b` share."""
    best, previous = 0, [0] * (len(b) + 1)
    for word in a:
        current = [0] * (len(b) + 1)
        for j, other in enumerate(b, start=1):
            if word == other:
                current[j] = previous[j - 1] + 1
                best = max(best, current[j])
        previous = current
    return best


def with_guard(fn: RewardFunction) -> RewardFunction:
    """`fn` (sync or async) with every game's score set to 0 and its reason recorded."""

    def guarded_reward(prompts: list[str], completions: list[str], **columns: Any) -> Any:
        values = fn(prompts, completions, **columns)
        if inspect.isawaitable(values):

            async def awaited() -> Any:
                return guarded(await values, prompts, completions)

            return awaited()
        return guarded(values, prompts, completions)

    return guarded_reward


def guarded(values: Any, prompts: list[str], completions: list[str]) -> Any:
    """`values` with each game's set to 0, as Rewards whose reason says the game (the function's own
    reason otherwise). Values of the wrong shape go through unchanged, for the caller's checks to name."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != len(completions):
        return values
    own = getattr(values, "reasons", [""] * len(completions))
    games = [game(p, c) for p, c in zip(prompts, completions, strict=True)]
    scores = [0.0 if why else v for v, why in zip(values, games, strict=True)]
    return Rewards(scores, [f"guard: {why}" if why else reason for why, reason in zip(games, own, strict=True)])
