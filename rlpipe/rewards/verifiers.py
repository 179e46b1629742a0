"""Built-in verifiers: reward functions (TRL's batch signature) whose 1.0 means correct. They read
the ground truth from the `reference` column."""

from __future__ import annotations

import logging


def exact_match(prompts: list[str], completions: list[str], reference: list[str], **_: object) -> list[float]:
    """1.0 when the completion (stripped) is exactly the reference, else 0.0."""
    return [float(c.strip() == str(r)) for c, r in zip(completions, reference, strict=True)]


def math_equivalence(prompts: list[str], completions: list[str], reference: list[str], **_: object) -> list[float]:
    """1.0 when the completion's final answer equals the reference mathematically, else 0.0.

    math-verify (HF's Math-Verify) extracts the answer (a \\boxed{} or $...$ LaTeX answer, else
    the last number or expression) and compares with sympy: 1/2 = 0.5 = \\frac{1}{2},
    2\\sqrt{2} = \\sqrt{8}, 50\\% = 0.5. A reference without $ or \\boxed is read as LaTeX math.
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
