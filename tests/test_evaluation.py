"""Held-out evaluation beyond greedy accuracy: k sampled completions per prompt (mean@k, the unbiased
pass@k, maj@k), named evaluation sets with their own rows, verifier and cadence, and an eval gate on
any of their metrics."""

import itertools
import json
import math
from pathlib import Path

import pytest

from rlpipe.spec import SpecError, parse_spec

from .conftest import initialize, tiny_spec_dict


def test_pass_at_k_is_the_unbiased_estimator():
    from rlpipe.evaluation.accuracy import pass_at

    # by hand: 1 - C(n - c, k) / C(n, k)
    assert pass_at(4, 1, 1) == 0.25
    assert pass_at(4, 1, 2) == 1 - 3 / 6
    assert pass_at(5, 2, 3) == 1 - 1 / 10
    assert pass_at(4, 0, 4) == 0.0 and pass_at(4, 4, 1) == 1.0 and pass_at(4, 1, 4) == 1.0
    # the chance that k of the n samples drawn without replacement hold a correct one
    for n, c in itertools.product(range(1, 7), range(7)):
        if c > n:
            continue
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            draws = list(itertools.combinations(range(n), k))
            exact = sum(any(outcomes[i] for i in draw) for draw in draws) / len(draws)
            assert math.isclose(pass_at(n, c, k), exact), (n, c, k)


def test_majority_votes_on_the_final_answer_and_scores_it():
    from rlpipe.evaluation.accuracy import majority_score, sampled_metrics

    # "3", "x = 3" and "so 3" give the final answer 3: it wins over 4 although 4 is a longer text
    assert majority_score(["4", "3", "x = 3", "so 3"], [0.0, 1.0, 1.0, 1.0]) == 1.0
    assert majority_score(["4", "4", "3"], [0.0, 0.0, 1.0]) == 0.0
    assert majority_score(["5", "6"], [0.0, 1.0]) == 0.0  # a tie: the answer given first
    metrics = sampled_metrics([["1", "2", "1", "1"], ["7", "8", "9", "7"]], [[1, 0, 1, 1], [0, 0, 0, 0]])
    assert metrics == {
        "eval/mean_at_4": 3 / 8,
        "eval/maj_at_4": 0.5,
        "eval/pass_at_1": (0.75 + 0.0) / 2,
        "eval/pass_at_2": (1.0 + 0.0) / 2,
        "eval/pass_at_4": (1.0 + 0.0) / 2,
    }


def test_evaluation_sets_are_checked(tmp_path: Path):
    with pytest.raises(SpecError, match="needs one of `path`"):
        parse_spec(tiny_spec_dict(tmp_path, evaluation={"sets": [{"name": "long"}]}))
    with pytest.raises(SpecError, match="names must differ"):
        two = [{"name": "a", "generator": "addition"}, {"name": "a", "generator": "sorting"}]
        parse_spec(tiny_spec_dict(tmp_path, evaluation={"sets": two}))
    with pytest.raises(SpecError, match=r"evaluation.sets\[0\].name"):
        parse_spec(tiny_spec_dict(tmp_path, evaluation={"sets": [{"name": "Long Set", "generator": "addition"}]}))


LENGTH_TWO = {"type": "tests.toy_plugins:length", "target": 2}  # 1.0 for completions of 2 characters


@pytest.fixture
def sampled_run(tmp_path: Path):
    """An initialized tiny run that evaluates 4 samples a prompt, and a named set (sorting rows, its own
    verifier, 3 samples) every 4 iterations."""

    rows = tmp_path / "held_out.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "reference": str(2 * a)}) + "\n" for a in range(12)))
    evaluation = {
        "samples": 4,
        "sets": [
            {"name": "sorting", "generator": "sorting", "options": {"max_digits": 6}, "size": 10, "every": 4,
             "verifier": LENGTH_TWO, "samples": 3},
            {"name": "doubles", "path": str(rows)},
        ],
    }  # fmt: skip
    spec = parse_spec(
        tiny_spec_dict(tmp_path, evaluation=evaluation, reward={"verifier": LENGTH_TWO}, loop={"iterations": 6})
    )
    run_root, cache = str(tmp_path / "runs" / "tiny"), str(tmp_path / "cache")
    initialize(spec, run_root, cache)
    return spec, run_root, cache


def _recomputed(samples: list[dict], prefix: str, k: int) -> dict[str, float]:
    """The sampled metrics from the recorded samples alone."""
    from rlpipe.evaluation.accuracy import pass_at, vote_key

    rewards = [[s["reward"] for s in row["samples"]] for row in samples]
    assert {len(r) for r in rewards} == {k}
    metrics = {f"{prefix}mean_at_{k}": sum(map(sum, rewards)) / (k * len(rewards))}
    for j in sorted({1, 2, k} & set(range(1, k + 1))):
        metrics[f"{prefix}pass_at_{j}"] = sum(pass_at(k, sum(r == 1.0 for r in row), j) for row in rewards) / len(
            rewards
        )
    majority = []
    for row in samples:
        keys = [vote_key(s["completion"]) for s in row["samples"]]
        top = max(keys.count(key) for key in keys)
        majority.append(row["samples"][next(i for i, key in enumerate(keys) if keys.count(key) == top)]["reward"])
    metrics[f"{prefix}maj_at_{k}"] = sum(majority) / len(majority)
    return metrics


def test_an_eval_records_sampled_metrics_that_its_samples_recompute(sampled_run):
    from rlpipe.loop import evaluate
    from rlpipe.store.run_root import read_eval_samples
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = sampled_run
    metrics = evaluate(spec, run_root, read_weight_ref(run_root, 0), 0, cache)
    recorded = json.loads((Path(run_root) / "metrics" / "eval_000000.json").read_text())
    assert recorded == metrics

    samples = read_eval_samples(run_root, 0)
    assert len(samples) == 20 and all(len(s["samples"]) == 4 for s in samples)
    expected = _recomputed(samples, "eval/", 4)
    assert {key: metrics[key] for key in expected} == pytest.approx(expected)
    assert metrics["eval/accuracy_greedy"] == sum(s["reward"] for s in samples) / 20
    assert 0 < metrics["eval/pass_at_4"] <= 1 and metrics["eval/pass_at_1"] <= metrics["eval/pass_at_4"]

    named = read_eval_samples(run_root, 0, "sorting")
    assert len(named) == 10 and named[0]["prompt"].endswith("=") and all(len(s["samples"]) == 3 for s in named)
    expected = _recomputed(named, "eval/sorting/", 3)
    assert {key: metrics[key] for key in expected} == pytest.approx(expected)
    doubles = read_eval_samples(run_root, 0, "doubles")
    assert [s["answer"] for s in doubles] == [str(2 * a) for a in range(12)]
    assert "eval/doubles/accuracy_greedy" in metrics and "eval/doubles/pass_at_4" in metrics  # evaluation.samples

    # `rlpipe status` and the evaluate step's KFP report show them
    from rlpipe.commands.status import describe, run_status
    from rlpipe.reports import eval_report

    status = run_status(run_root)
    assert status["last_eval"]["metrics"]["eval/pass_at_4"] == metrics["eval/pass_at_4"]
    assert f"pass_at_4 {metrics['eval/pass_at_4']:.3f}" in describe(status)
    assert "sorting/accuracy_greedy" in describe(status)
    report = eval_report(run_root, 0)
    assert "`eval/maj_at_4`" in report and "sampled correct" in report

    # the named sets' cadence: sorting every 4 (and at the first and last), doubles at every eval (2)
    from rlpipe.evaluation.cadence import eval_sets_due

    both = ["sorting", "doubles"]
    due = {n: [s.name for s in eval_sets_due(spec, n)] for n in range(7)}
    assert due == {0: both, 1: [], 2: ["doubles"], 3: [], 4: both, 5: [], 6: both}


def test_an_eval_gate_on_pass_at_k_stops_the_loop_where_greedy_accuracy_would_not(sampled_run):
    """The same eval twice: a gate on eval/pass_at_4 at what the eval measures stops the loop (state.json
    records it); at greedy accuracy's value it would not, as pass@4 >= pass@1."""
    from rlpipe.loop import evaluate
    from rlpipe.spec import spec_to_dict
    from rlpipe.store.run_root import read_state
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = sampled_run
    measured = evaluate(spec, run_root, read_weight_ref(run_root, 0), 0, cache)
    assert measured["eval/pass_at_4"] > measured["eval/accuracy_greedy"]  # sampling finds what greedy misses
    (Path(run_root) / "metrics" / "eval_000000.json").unlink()  # evaluate again, with the gate
    data = spec_to_dict(spec)
    data["loop"]["stop_when"] = f"eval/pass_at_4 >= {measured['eval/pass_at_4']}"
    gated = parse_spec(data)
    again = evaluate(gated, run_root, read_weight_ref(run_root, 0), 0, cache)
    assert again["eval/pass_at_4"] == measured["eval/pass_at_4"]  # the same seeded samples
    stopped = read_state(run_root)["stopped"]
    assert stopped["iteration"] == 0 and stopped["reason"].startswith("eval/pass_at_4 ")
    assert stopped["when"] == gated.loop.stop_when
