"""Addition: prompt "37+45=", answer "82". Verifiable, tiny-vocab, learnable by a ~1M model."""

from __future__ import annotations

import random


def make_rows(rng: random.Random, n: int, digits: int = 2) -> list[dict[str, str]]:
    """n distinct problems a+b with 0 <= a, b < 10**digits."""
    limit = 10**digits
    if n > limit * limit:
        raise ValueError(
            f"task.addition with digits={digits} has only {limit * limit} distinct problems, asked for {n}"
        )
    rows: list[dict[str, str]] = []
    for index in rng.sample(range(limit * limit), n):
        a, b = divmod(index, limit)
        rows.append({"prompt": f"{a}+{b}=", "reference": str(a + b)})
    return rows
