"""Built-in verifiers: reward functions (TRL's batch signature) whose 1.0 means correct."""

from __future__ import annotations


def exact_match(prompts: list[str], completions: list[str], reference: list[str], **_: object) -> list[float]:
    """1.0 when the completion (stripped) is exactly the sum, else 0.0."""
    return [float(c.strip() == r) for c, r in zip(completions, reference, strict=True)]
