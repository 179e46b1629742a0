"""Markdown reports that the KFP UI renders (a step's Markdown output artifact, under Visualizations):

    rollout_samples  advantages:   the reward distribution of the iteration's rollouts, and the completions
                                   of its best and worst groups with their rewards and advantages
    eval_samples     evaluate:     held-out greedy accuracy, the signs that the run does not learn (a
                                   degenerate start, no reward, collapse), and the held-out rows' completions
    time_breakdown   sync_weights: where the iteration's wall time went

Plain functions of files and metrics dicts, without KFP. The light steps write one every iteration, so
they stay cheap: pyarrow, no pandas. Which step writes which is the step table's (rlpipe.steps.Step.reports);
every path writes them through `step_reports`: a KFP component to its Markdown outputs, the in-process
loop and the Argo steps to `<report>.md` files beside the iteration's artifacts (`write_reports`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

from rlpipe.metric_keys import EVAL_ACCURACY, EVAL_STRICT, EVAL_WEIGHTS_VERSION, ITERATION_OVERHEAD, ITERATION_WALL

PROMPT_CHARS = 200  # a prompt's last characters: a template's question comes last
COMPLETION_CHARS = 300
BAR_WIDTH = 20
# ASCII punctuation that Markdown or inline HTML would read; `|` ends a table cell
MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_\[\]<>|~&])")


def cell(value: Any, limit: int = COMPLETION_CHARS, keep_end: bool = False) -> str:
    """`value` as one Markdown table cell: at most `limit` characters (the first ones, or the last with
    `keep_end`, marked …), Markdown punctuation and pipes escaped, newlines as <br>."""
    text = "" if value is None else str(value)
    if len(text) > limit:
        text = "…" + text[-limit:] if keep_end else text[:limit] + "…"
    if not text.strip():
        return "*(blank)*" if value is not None else ""
    text = MARKDOWN_PUNCTUATION.sub(r"\\\1", text)
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")


def table(header: list[str], rows: list[list[str]], align: str) -> str:
    """A Markdown table; `align` has one character per column: l(eft) or r(ight)."""
    rule = ["---:" if a == "r" else ":---" for a in align]
    return "\n".join("| " + " | ".join(row) + " |" for row in [header, rule, *rows])


def bar(count: float, largest: float) -> str:
    return "█" * round(BAR_WIDTH * count / largest) if largest > 0 else ""


def share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "–"


# --- advantages: rollout samples -------------------------------------------------------------


def reward_histogram(rewards: list[float], bins: int = 10) -> list[tuple[str, int]]:
    """(label, count) per distinct reward when there are at most `bins` of them, else per one of
    `bins` equal-width intervals from the lowest reward to the highest."""
    distinct = sorted(set(rewards))
    if len(distinct) <= bins:
        tally = Counter(rewards)
        return [(f"{value:.4g}", tally[value]) for value in distinct]
    low, width = distinct[0], (distinct[-1] - distinct[0]) / bins
    counts = [0] * bins
    for reward in rewards:
        counts[min(int((reward - low) / width), bins - 1)] += 1
    edges = [low + i * width for i in range(bins + 1)]
    return [(f"[{edges[i]:.3g}, {edges[i + 1]:.3g}{']' if i == bins - 1 else ')'}", counts[i]) for i in range(bins)]


def _groups(group_ids: list[int], rewards: list[float]) -> dict[int, list[float]]:
    groups: dict[int, list[float]] = {}
    for group, reward in zip(group_ids, rewards, strict=True):
        groups.setdefault(group, []).append(reward)
    return groups


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _advantage(row: dict[str, Any]) -> str:
    if "advantage" in row:
        return f"{row['advantage']:+.3f}"
    tokens = row.get("token_advantages") or []  # a critic's per-token advantages (PPO): their mean
    return f"{sum(tokens) / len(tokens):+.3f} (token mean)" if tokens else ""


def _samples_table(rows: list[dict[str, Any]], groups: list[int], per_group: int) -> str:
    lines = []
    for group in groups:
        samples = sorted((r for r in rows if r["group_id"] == group), key=lambda r: r["sample_index"])
        mean, std = _mean_std([r["reward"] for r in samples])
        for k, row in enumerate(samples[:per_group]):
            first = k == 0
            lines.append(
                [
                    f"{group} (mean {mean:.3g}, std {std:.3g})" if first else "",
                    cell(row["prompt"], PROMPT_CHARS, keep_end=True) if first else "〃",
                    cell(row.get("transcript") or row["completion"]),  # a trajectory: observations too
                    f"{row['reward']:.4g}",
                    _advantage(row),
                ]
            )
        if len(samples) > per_group:
            lines.append(["", "", f"*… {len(samples) - per_group} more samples of this group*", "", ""])
    return table(["group", "prompt", "completion", "reward", "advantage"], lines, "lllrr")


def samples_report(scored_path: str, batch_path: str, groups: int = 2, per_group: int = 8) -> str:
    """The iteration's rollouts: the reward distribution of every sampled completion (`scored_path`),
    then the `groups` groups of the batch (`batch_path`, with advantages) with the highest mean reward
    and the `groups` with the lowest, ties broken by the larger reward spread (the groups that teach)."""
    import pyarrow.parquet as pq

    scored = pq.ParquetFile(scored_path).read(columns=["group_id", "reward"]).to_pydict()
    batch_file = pq.ParquetFile(batch_path)
    advantages = [name for name in ("advantage", "token_advantages") if name in batch_file.schema_arrow.names]
    columns = ["iteration", "group_id", "sample_index", "prompt", "completion", "reward", *advantages[:1]]
    columns += [name for name in ("transcript",) if name in batch_file.schema_arrow.names]
    batch = batch_file.read(columns=columns).to_pylist()
    rewards = scored["reward"]
    iteration = batch[0]["iteration"] if batch else "?"
    if not rewards:
        return f"## Rollouts of iteration {iteration}\n\nNo completions were scored."
    sampled = _groups(scored["group_id"], rewards)
    trained = _groups([r["group_id"] for r in batch], [r["reward"] for r in batch])
    zero_spread = sum(max(r) == min(r) for r in sampled.values())
    mean, std = _mean_std(rewards)
    histogram = reward_histogram(rewards)
    largest = max(count for _, count in histogram)
    lines = [
        f"## Rollouts of iteration {iteration}",
        "",
        f"{len(rewards)} completions in {len(sampled)} groups (one group: the samples of one prompt); "
        f"the batch trains on {len(batch)} of them in {len(trained)} groups.",
        "",
        f"Reward: mean {mean:.4g}, std {std:.4g}, min {min(rewards):.4g}, max {max(rewards):.4g}. "
        f"Groups whose rewards are all equal (no signal for a group-relative advantage): "
        f"{zero_spread} of {len(sampled)} ({share(zero_spread, len(sampled))}).",
        "",
        "### Reward distribution",
        "",
        table(
            ["reward", "count", "share", ""],
            [[label, str(count), share(count, len(rewards)), bar(count, largest)] for label, count in histogram],
            "rrrl",
        ),
    ]
    stats = {group: _mean_std(group_rewards) for group, group_rewards in trained.items()}
    best = sorted(stats, key=lambda g: (-stats[g][0], -stats[g][1], g))[:groups]
    worst = [g for g in sorted(stats, key=lambda g: (stats[g][0], -stats[g][1], g)) if g not in best][:groups]
    for title, chosen in (("Best groups: highest mean reward", best), ("Worst groups: lowest mean reward", worst)):
        if chosen:
            lines += ["", f"### {title}", "", _samples_table(batch, chosen, per_group)]
    return "\n".join(lines) + "\n"


# --- evaluate: held-out samples --------------------------------------------------------------


def eval_report(run_root: str, iteration: int, max_rows: int = 50) -> str:
    """Iteration N's held-out eval (metrics/eval_N.json): greedy accuracy, the signs that the run does not
    learn (signs_section), then the first `max_rows` held-out rows in the set's order (the same rows every
    eval, so reports compare across iterations)."""
    from rlpipe.store.run_root import eval_metrics_uri, read_eval_samples, read_json

    metrics = read_json(eval_metrics_uri(run_root, iteration))
    if metrics is None:
        return f"## Held-out eval of iteration {iteration}\n\nNo eval recorded for iteration {iteration}.\n"
    samples = read_eval_samples(run_root, iteration)
    version = int(metrics.get(EVAL_WEIGHTS_VERSION, iteration))
    correct = sum(bool(s["correct"]) for s in samples)
    lines = [
        f"## Held-out eval of iteration {iteration} (weights v{version})",
        "",
        f"Greedy accuracy (`{EVAL_ACCURACY}`): **{metrics[EVAL_ACCURACY]:.4f}**"
        + (f" ({correct} of {len(samples)} rows fully correct)" if samples else ""),
    ]
    if EVAL_STRICT in metrics:
        lines += [
            "",
            f"Strict accuracy (`{EVAL_STRICT}`, the final answer is the expected one character for character): "
            f"**{metrics[EVAL_STRICT]:.4f}**",
        ]
    lines += signs_section(run_root, iteration)
    strict_column = any(s.get("strict") is not None for s in samples)
    sampled_column = bool(samples) and "samples" in samples[0]  # evaluation.samples
    for key in sorted(metrics):
        if key.startswith("eval/") and key not in (EVAL_ACCURACY, EVAL_STRICT, EVAL_WEIGHTS_VERSION):
            lines.append(f"\n`{key}`: {metrics[key]:.4g}")
    if not samples:
        return "\n".join(lines + ["", "No held-out samples were recorded with this eval."]) + "\n"
    rows = [
        [
            str(s["index"]),
            cell(s["prompt"], PROMPT_CHARS, keep_end=True),
            cell(s.get("transcript") or s["completion"]),
            cell(s["answer"]),
            ("✓" if s["correct"] else "✗") + ("" if s["reward"] in (0.0, 1.0) else f" {s['reward']:.3g}"),
            *([("✓" if s.get("strict") else "✗")] if strict_column else []),
            *([f"{sum(x['reward'] >= 1.0 for x in s['samples'])}/{len(s['samples'])}"] if sampled_column else []),
        ]
        for s in samples[:max_rows]
    ]
    headers = ["#", "prompt", "greedy completion", "expected", "correct", *(["strict"] if strict_column else [])]
    headers += ["sampled correct"] if sampled_column else []
    lines += ["", table(headers, rows, "rlllr" + "r" * strict_column + "r" * sampled_column)]
    if len(samples) > max_rows:
        lines += [
            "",
            f"The first {max_rows} of {len(samples)} rows; metrics/eval_{iteration:06d}_samples.jsonl has all.",
        ]
    return "\n".join(lines) + "\n"


def signs_section(run_root: str, iteration: int) -> list[str]:
    """The signs that the run does not learn, up to iteration N (rlpipe.evaluation.diagnosis.signs_at: a
    degenerate start at 0, no reward, collapse), each with its likely causes and what to try; [] when none."""
    from rlpipe.evaluation.diagnosis import signs_at
    from rlpipe.evaluation.stopping import recorded_stop
    from rlpipe.store.run_root import read_state

    signs = signs_at(run_root, iteration)
    if not signs:
        return []
    stop = recorded_stop(read_state(run_root) or {})
    lines = ["", "### Signs that the run does not learn", ""]
    for sign in signs:
        ended = " **The loop stopped here: start a new run once the cause is fixed.**" if sign.stops else ""
        ended = ended if stop is not None and stop.sign == sign.name else ""
        seen, causes, remedy = (cell(text, 1000) for text in (sign.seen, sign.causes, sign.remedy))
        lines.append(f"- **{seen}**{ended}<br>likely causes: {causes}<br>try: {remedy}")
    return lines


# --- sync_weights: time breakdown ------------------------------------------------------------


def time_report(metrics: dict[str, float], iteration: int) -> str:
    """Where iteration N's wall time (time/iteration_wall_s) went: each step's compute (time/*) and each
    recorded overhead (overhead/*: imports, model loads), then the overhead no step itemized (process
    starts, scheduling, artifact passing), with their shares of the wall time. The parts add up to it,
    unless overheads overlap (steps of an asynchronous run)."""
    title = f"## Where iteration {iteration}'s time went"
    if not metrics:
        committed = f"metrics/iter_{iteration:06d}.json"
        return f"{title}\n\nAn earlier attempt of this step committed iteration {iteration}: see {committed}.\n"
    compute = {k: v for k, v in metrics.items() if k.startswith("time/") and k.endswith("_s") and k != ITERATION_WALL}
    overhead = {
        k: v for k, v in metrics.items() if k.startswith("overhead/") and k.endswith("_s") and k != ITERATION_OVERHEAD
    }
    parts = [(f"`{k}`", "compute", v) for k, v in compute.items()]
    parts += [(f"`{k}`", "overhead", v) for k, v in overhead.items()]
    wall = metrics.get(ITERATION_WALL)
    if wall is not None and ITERATION_OVERHEAD in metrics:
        rest = max(0.0, metrics[ITERATION_OVERHEAD] - sum(overhead.values()))
        parts.append(("the rest: process starts, scheduling, artifact passing", "overhead", rest))
    parts.sort(key=lambda part: -part[2])
    whole = wall if wall else sum(part[2] for part in parts)
    largest = max((part[2] for part in parts), default=0.0)
    rows = [
        [label, kind, f"{seconds:.3f}", share(seconds, whole), bar(seconds, largest)] for label, kind, seconds in parts
    ]
    busy = sum(compute.values())
    if wall:
        summary = (
            f"Wall time {wall:.2f} s from the iteration's first step's start to the commit: compute {busy:.2f} s "
            f"({share(busy, wall)}), overhead {wall - busy:.2f} s ({share(wall - busy, wall)})."
        )
        rows.append(["**iteration wall time**", "", f"**{wall:.3f}**", "100%", ""])
    else:
        summary = "No wall time was recorded for this iteration: shares are of the parts' sum."
    return "\n".join([title, "", summary, "", table(["part", "kind", "seconds", "share", ""], rows, "llrrl")]) + "\n"


# --- which report each step writes -----------------------------------------------------------


def step_reports(
    step: str,
    *,
    iteration: int = 0,
    run_root: str = "",
    scored_path: str = "",
    batch_path: str = "",
    metrics: dict[str, float] | None = None,
) -> dict[str, str]:
    """The Markdown of every report the step table gives `step`, by report name ({} for a step
    without reports). Each report reads only what its step has at hand."""
    from rlpipe.steps import BY_NAME

    writers = {
        "rollout_samples": lambda: samples_report(scored_path, batch_path),
        "time_breakdown": lambda: time_report(metrics or {}, iteration),
        "eval_samples": lambda: eval_report(run_root, iteration),
    }
    return {name: writers[name]() for name in BY_NAME[step].reports}


def write_reports(step: str, directory: str | Path, **context: Any) -> list[Path]:
    """`step_reports` as `<directory>/<report>.md` files (the in-process loop and the Argo steps, which
    have no KFP UI to render them); returns the files written."""
    written = []
    for name, text in step_reports(step, **context).items():
        path = Path(directory) / f"{name}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
