"""Built-in verifiers: reward functions (TRL's batch signature) whose 1.0 means correct. As
functions ('rlpipe.rewards.verifiers:exact_match') they read the ground truth from the `reference`
column; as reward types ({type: exact_match, answer_column: answer}) from the column named."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rlpipe.rewards import RewardError, RewardFunction, register_reward_type
from rlpipe.rewards.shaping import options_of


def exact_match(prompts: list[str], completions: list[str], reference: list[str], **_: object) -> list[float]:
    """1.0 when the completion (stripped) is exactly the reference, else 0.0."""
    return [float(c.strip() == str(r)) for c, r in zip(completions, reference, strict=True)]


def math_equivalence(prompts: list[str], completions: list[str], reference: list[str], **_: object) -> list[float]:
    """1.0 when the completion's final answer equals the reference mathematically, else 0.0.

    math-verify (HF's Math-Verify) extracts the answer (a \\boxed{} or $...$ LaTeX answer, else
    the last number or expression) and compares with sympy: 1/2 = 0.5 = \\frac{1}{2},
    2\\sqrt{2} = \\sqrt{8}, (x+1)^2 = x^2+2x+1. A reference without $ or \\boxed is read as LaTeX math.
    Its own signal timeouts are off (they need the main thread); reward.timeout_s bounds the call.
    """
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    scores = []
    for completion, ref in zip(completions, reference, strict=True):
        ref = str(ref)
        gold = parse(ref if "$" in ref or "\\boxed" in ref else f"${ref}$", parsing_timeout=None)
        answer = parse(completion, parsing_timeout=None)
        scores.append(float(bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)))
    return scores


def _verifier_type(verify: RewardFunction, kind: str) -> Callable[[dict[str, Any], str], RewardFunction]:
    """{type: exact_match | math_equivalence, answer_column: answer}: the verifier reading the
    ground truth from `answer_column` (default `reference`)."""

    def build(options: dict[str, Any], key: str) -> RewardFunction:
        options_of(options, {"answer_column": str}, (), key, kind)
        column = options.get("answer_column", "reference")

        def verifier(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
            if column not in columns:
                raise RewardError(f"{kind} needs the data column {column!r} (answer_column); have {sorted(columns)}")
            return verify(prompts, completions, columns[column])

        return verifier

    return build


register_reward_type("exact_match", _verifier_type(exact_match, "exact_match"))
register_reward_type("math_equivalence", _verifier_type(math_equivalence, "math_equivalence"))
