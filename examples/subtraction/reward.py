"""The subtraction task's own reward: a plain function with TRL's signature. `answer` is a column of
the data files; every column reaches reward functions as a keyword list, one entry per completion.

The spec names it 'examples.subtraction.reward:correct'; rlpipe imports it from the directory it
runs in (put your own module there, or install it)."""

from __future__ import annotations


def correct(prompts: list[str], completions: list[str], answer: list[str], **columns: object) -> list[float]:
    """1.0 when the completion is the difference (e.g. '-27' for '18-45='), else 0.0."""
    return [float(completion.strip() == expected) for completion, expected in zip(completions, answer, strict=True)]
