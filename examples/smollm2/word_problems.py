"""One-step arithmetic word problems for a small instruct model: four kinds (addition, subtraction,
multiplication, sharing equally), each over several names and things, small numbers.

    rows = make_rows(random.Random(0), 1000)  # {question, answer, kind}

Rows are distinct (no question twice), so rlpipe's first `eval_size` rows, held out, never
appear among the train rows. `answer` is the value as text ("17").
"""

from __future__ import annotations

import random
from collections.abc import Callable

NAMES = ["Tom", "Sara", "Ali", "Mia", "Ben", "Lena", "Omar", "Ivy", "Noah", "Emma"]
THINGS = ["apples", "stickers", "marbles", "pencils", "books", "cookies", "coins", "cards"]
CONTAINERS = ["box", "bag", "jar", "basket"]
GROUPS = ["children", "friends", "students", "players"]


def addition(rng: random.Random) -> tuple[str, int]:
    name, thing, a, b = rng.choice(NAMES), rng.choice(THINGS), rng.randint(2, 20), rng.randint(2, 20)
    return f"{name} has {a} {thing}. {name} gets {b} more. How many {thing} does {name} have now?", a + b


def subtraction(rng: random.Random) -> tuple[str, int]:
    name, thing, a = rng.choice(NAMES), rng.choice(THINGS), rng.randint(10, 40)
    b = rng.randint(2, a - 1)
    return f"{name} had {a} {thing} and gave {b} of them away. How many {thing} does {name} have left?", a - b


def multiplication(rng: random.Random) -> tuple[str, int]:
    box, thing, a, b = rng.choice(CONTAINERS), rng.choice(THINGS), rng.randint(2, 10), rng.randint(2, 9)
    plural = "boxes" if box == "box" else f"{box}s"
    return f"A {box} holds {a} {thing}. How many {thing} are in {b} {plural}?", a * b


def sharing(rng: random.Random) -> tuple[str, int]:
    thing, group, each, count = rng.choice(THINGS), rng.choice(GROUPS), rng.randint(2, 9), rng.randint(2, 9)
    one = group.removesuffix("ren").removesuffix("s")  # children -> child, friends -> friend
    return (
        f"{each * count} {thing} are shared equally among {count} {group}. How many {thing} does each {one} get?",
        each,
    )


KINDS: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "addition": addition,
    "subtraction": subtraction,
    "multiplication": multiplication,
    "sharing": sharing,
}


def make_rows(rng: random.Random, n: int, kinds: list[str] | None = None) -> list[dict]:
    """`n` distinct problems, the kinds in turn (all four unless `kinds` names some)."""
    names = kinds or list(KINDS)
    unknown = sorted(set(names) - set(KINDS))
    if unknown:
        raise ValueError(f"data.options.kinds: unknown kinds {unknown}; choose from {list(KINDS)}")
    rows: list[dict] = []
    seen: set[str] = set()
    attempts = 0
    while len(rows) < n:
        kind = names[len(rows) % len(names)]
        question, answer = KINDS[kind](rng)
        attempts += 1
        if attempts > 100 * n:
            raise ValueError(f"only {len(rows)} distinct problems of kinds {kinds}; ask for fewer rows")
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": str(answer), "kind": kind})
    return rows
