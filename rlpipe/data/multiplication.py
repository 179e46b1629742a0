"""Multiplication with a calculator: prompt "37*48=", answer "1776". Too hard for the ~1M demo model to
compute, easy with the calculator environment (rlpipe.environments.tools): the model calls it with
" 37*48=" (a leading space marks a call, the tiny vocabulary's <tool_call>, so deciding to call and
copying the expression are separate tokens), the calculator answers "1776 ", the model copies it.

Each row carries a `demonstration` for the multi-turn warm start (model.warm_start.transcript): the
calculator transcript for a `tool_fraction` of the rows, the bare answer for the rest, so the warm
start knows the tool format but seldom chooses it, and RL finds out that it pays.
"""

from __future__ import annotations

import json
import random


def make_rows(rng: random.Random, n: int, digits: int = 2, tool_fraction: float = 0.2) -> list[dict[str, str]]:
    """n distinct problems a*b with 0 <= a, b < 10**digits."""
    limit = 10**digits
    if n > limit * limit:
        raise ValueError(
            f"data.generator multiplication with digits={digits} has only {limit * limit} distinct problems, "
            f"asked for {n}"
        )
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"data.options.tool_fraction must be within [0, 1], got {tool_fraction}")
    rows: list[dict[str, str]] = []
    for index in rng.sample(range(limit * limit), n):
        a, b = divmod(index, limit)
        answer = str(a * b)
        turns = [{"role": "model", "text": answer}]
        if rng.random() < tool_fraction:
            call = [{"role": "model", "text": f" {a}*{b}="}, {"role": "environment", "text": f"{answer} "}]
            turns = call + turns
        rows.append({"prompt": f"{a}*{b}=", "reference": answer, "demonstration": json.dumps(turns)})
    return rows
