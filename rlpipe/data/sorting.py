"""Digit sorting with long-tailed lengths: prompt "8412=", answer "1248".

The generation-heavy workload of benchmarks/async.py. An answer is as long as its prompt, and the
lengths have a long tail: digits = min_digits + a geometric draw, so most answers are a few tokens
and a few are tens. That is the shape of reasoning RL's completions (most short, some an order of
magnitude longer), and it makes generation the larger part of an iteration: a batch decodes until
its longest completion ends (or max_new_tokens), while the update trains on the tokens there are.
"""

from __future__ import annotations

import random


def make_rows(
    rng: random.Random, n: int, min_digits: int = 3, max_digits: int = 30, tail: float = 0.85
) -> list[dict[str, str]]:
    """n distinct digit strings, each min_digits + k digits long (P(k) ~ tail**k, at most
    max_digits), with their digits sorted as the reference."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"data.options: need 1 <= min_digits <= max_digits, got {min_digits} and {max_digits}")
    if not 0.0 <= tail < 1.0:
        raise ValueError(f"data.options.tail must be within [0, 1), got {tail}")
    if n > 10 ** min(max_digits, 9):
        raise ValueError(f"data.generator sorting: asked for {n} distinct rows of at most {max_digits} digits")
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        length = min_digits
        while length < max_digits and rng.random() < tail:
            length += 1
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        if digits in seen:
            continue
        seen.add(digits)
        rows.append({"prompt": f"{digits}=", "reference": "".join(sorted(digits))})
    return rows
