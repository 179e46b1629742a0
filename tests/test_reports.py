"""The Markdown reports the KFP UI renders (rlpipe.reports), on small hand-made inputs."""

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.reports import cell, eval_report, reward_histogram, samples_report, time_report
from rlpipe.store.run_root import eval_metrics_uri, read_eval_samples, write_eval_samples, write_json

# group -> its samples' rewards: means 1, 2/3, 1/2, 1/3, 0; groups 0 and 4 have no spread
GROUP_REWARDS = {0: [1.0, 1.0, 1.0], 1: [1.0, 1.0, 0.0], 2: [1.0, 0.0, 0.5], 3: [0.0, 1.0, 0.0], 4: [0.0, 0.0, 0.0]}


def _section(text: str, heading: str) -> str:
    return text.split(f"### {heading}", 1)[1].split("\n### ", 1)[0]


def _table_rows(section: str) -> list[list[str]]:
    """The cells of a Markdown table's body rows (after the header and the rule)."""
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]


def _write_rollouts(tmp_path: Path, advantage_column: str = "advantage") -> tuple[str, str]:
    rows = [
        {
            "iteration": 7,
            "group_id": group,
            "sample_index": k,
            "prompt": f"<system>\nWhat is {group} | {group}?",
            "completion": "x" * 1000 if (group, k) == (1, 2) else f"ans g{group} s{k}\nsecond|line",
            "reward": reward,
        }
        for group, rewards in GROUP_REWARDS.items()
        for k, reward in enumerate(rewards)
    ]
    for row in rows:
        advantage = row["reward"] - sum(GROUP_REWARDS[row["group_id"]]) / 3
        row[advantage_column] = advantage if advantage_column == "advantage" else [advantage, advantage]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table.drop_columns([advantage_column]), tmp_path / "scored.parquet")
    pq.write_table(table, tmp_path / "batch.parquet")
    return str(tmp_path / "scored.parquet"), str(tmp_path / "batch.parquet")


def test_cells_are_escaped_and_truncated():
    assert cell("a|b\nc *d* <br>") == r"a\|b<br>c \*d\* \<br\>"
    assert cell("x" * 50, limit=10) == "x" * 10 + "…"
    assert cell("head " + "y" * 50, limit=10, keep_end=True) == "…" + "y" * 10
    assert cell("") == "*(blank)*" and cell(None) == ""


def test_samples_report_shows_the_distribution_and_the_best_and_worst_groups(tmp_path: Path):
    text = samples_report(*_write_rollouts(tmp_path))
    assert text.startswith("## Rollouts of iteration 7")
    assert "15 completions in 5 groups" in text
    assert "mean 0.5, std 0.483, min 0, max 1" in text
    assert "2 of 5 (40.0%)" in text  # groups 0 and 4 have all-equal rewards

    histogram = _table_rows(_section(text, "Reward distribution"))
    assert [(row[0], int(row[1])) for row in histogram] == [("0", 7), ("0.5", 1), ("1", 7)]
    assert sum(int(row[1]) for row in histogram) == 15  # the counts add up to the rows

    best, worst = _section(text, "Best groups"), _section(text, "Worst groups")
    assert "ans g0 s0" in best and "ans g1 s0" in best  # the two highest mean rewards
    assert "ans g4 s0" in worst and "ans g3 s0" in worst  # the two lowest
    assert "ans g2" not in text  # the middle group is in neither
    rows = _table_rows(best)
    assert len(rows) == 6 and [row[3] for row in rows] == ["1", "1", "1", "1", "1", "0"]
    assert rows[3][0].startswith("1 (mean 0.667") and rows[4][1] == "〃"  # the prompt once per group
    assert rows[3][1] == r"\<system\><br>What is 1 \| 1?"  # pipes, newlines and markup escaped
    assert rows[0][2] == r"ans g0 s0<br>second\|line" and rows[0][4] == "+0.000"
    assert rows[5][2] == "x" * 300 + "…" and rows[5][4] == "-0.667"  # a long completion is cut


def test_samples_report_of_a_critic_shows_the_token_mean_advantage(tmp_path: Path):
    text = samples_report(*_write_rollouts(tmp_path, "token_advantages"), groups=1, per_group=2)
    rows = _table_rows(_section(text, "Worst groups"))
    assert rows[0][0].startswith("4 ") and rows[0][4] == "+0.000 (token mean)"
    assert "1 more samples of this group" in rows[2][2]


def test_reward_histogram_bins_many_distinct_rewards():
    rewards = [i / 99 for i in range(100)] + [1.0]
    histogram = reward_histogram(rewards)
    assert len(histogram) == 10 and sum(count for _, count in histogram) == 101
    assert histogram[0] == ("[0, 0.1)", 10) and histogram[-1] == ("[0.9, 1]", 11)


def test_eval_report_shows_the_accuracy_and_the_held_out_rows(tmp_path: Path):
    run_root = str(tmp_path)
    assert "No eval recorded for iteration 4" in eval_report(run_root, 4)
    samples = [
        {"index": 0, "prompt": "1+1=", "completion": "2", "answer": "2", "reward": 1.0, "correct": True},
        {"index": 1, "prompt": "a|b", "completion": "c\nd", "answer": "e", "reward": 0.0, "correct": False},
        {"index": 2, "prompt": "2+2=", "completion": "4", "answer": "4", "reward": 1.0, "correct": True},
    ]
    write_eval_samples(run_root, 4, samples)
    write_json(eval_metrics_uri(run_root, 4), {"eval/accuracy_greedy": 2 / 3, "eval/weights_version": 4.0})
    assert read_eval_samples(run_root, 4) == samples
    text = eval_report(run_root, 4, max_rows=2)
    assert text.startswith("## Held-out eval of iteration 4 (weights v4)")
    assert "**0.6667** (2 of 3 rows fully correct)" in text
    rows = _table_rows(text)
    assert rows == [["0", "1+1=", "2", "2", "✓"], ["1", r"a\|b", "c<br>d", "e", "✗"]]
    assert "The first 2 of 3 rows" in text and "Strict accuracy" not in text  # a run recorded before it

    samples = [s | {"strict": s["correct"] and s["index"] == 0} for s in samples]
    write_eval_samples(run_root, 5, samples)
    write_json(eval_metrics_uri(run_root, 5), {"eval/accuracy_greedy": 2 / 3, "eval/accuracy_strict": 1 / 3})
    text = eval_report(run_root, 5)
    assert "Strict accuracy (`eval/accuracy_strict`, the final answer is the expected one character for " in text
    assert "**0.3333**" in text and "| correct | strict |" in text
    assert [row[-2:] for row in _table_rows(text)] == [["✓", "✓"], ["✗", "✗"], ["✓", "✗"]]


def test_time_report_shares_add_up_to_the_wall_time():
    metrics = {
        "time/generate_s": 2.0,
        "time/update_s": 5.0,
        "overhead/update_import_s": 1.0,
        "overhead/iteration_s": 3.0,  # wall - compute
        "time/iteration_wall_s": 10.0,
        "reward/mean": 0.5,
    }
    text = time_report(metrics, 3)
    assert text.startswith("## Where iteration 3's time went")
    assert "compute 7.00 s (70.0%), overhead 3.00 s (30.0%)" in text
    rows = _table_rows(text)
    parts = {row[0]: (float(row[2]), row[3]) for row in rows[:-1]}
    assert parts == {
        "`time/update_s`": (5.0, "50.0%"),
        "`time/generate_s`": (2.0, "20.0%"),
        "the rest: process starts, scheduling, artifact passing": (2.0, "20.0%"),
        "`overhead/update_import_s`": (1.0, "10.0%"),
    }
    assert rows[0][0] == "`time/update_s`"  # the largest first
    assert sum(seconds for seconds, _ in parts.values()) == 10.0 and rows[-1][2] == "**10.000**"
    assert "reward" not in text
    assert "committed iteration 3" in time_report({}, 3)  # a retried sync after its commit
