"""A degenerate start, an iteration without reward and a collapse are named (rlpipe.evaluation.diagnosis):
each detector on synthetic records, the demo's records naming nothing, and the loop's own functions stopping
at the first two, with the reason in state.json, `rlpipe status`, the eval report and `rlpipe run`'s end."""

from pathlib import Path

import pytest

from rlpipe.evaluation.diagnosis import (
    accuracy_fell,
    collapse_signs,
    degenerate_start,
    entropy_fell,
    no_reward,
    no_spread,
)
from rlpipe.evaluation.stopping import StoppedBySign, should_stop

from .conftest import initialized

# the demo's (examples/addition.yaml, seed 0) first iterations and evals: it learns, and nothing is named
DEMO_ITERATIONS = {
    i: {"reward/mean": reward, "reward/std": 0.45, "reward/max": 1.0, "policy/entropy": entropy,
        "groups/zero_variance_fraction": spread}
    for i, reward, entropy, spread in [
        (1, 0.221, 0.662, 0.262), (2, 0.250, 0.644, 0.209), (3, 0.276, 0.631, 0.203), (4, 0.302, 0.601, 0.182),
        (5, 0.295, 0.585, 0.209), (6, 0.313, 0.557, 0.188), (7, 0.354, 0.531, 0.176), (8, 0.383, 0.526, 0.166),
    ]
}  # fmt: skip
DEMO_EVALS = {0: 0.412, 5: 0.578, 10: 0.614, 15: 0.604, 20: 0.664, 25: 0.666}


def _samples(completions: list[str], rewards: list[float] | None = None) -> list[dict]:
    rewards = rewards or [0.0] * len(completions)
    return [
        {"index": i, "prompt": f"{i}+1=", "completion": c, "answer": str(i + 1), "reward": r, "correct": r >= 1}
        for i, (c, r) in enumerate(zip(completions, rewards, strict=True))
    ]


def test_a_degenerate_start_is_one_answer_for_every_held_out_prompt_right_for_none():
    sign = degenerate_start(_samples(["\nAnswer:\nAnswer:"] * 19 + ["\nAnswer:\nAnswer: "]))
    assert sign is not None and sign.stops and sign.iteration == 0
    assert "every held-out answer at iteration 0 is the same string, '\\nAnswer:\\nAnswer:'" in sign.seen
    for cause in ("tokenization", "missing BOS", "`rlpipe check`", "data.chat_template", "max_new_tokens"):
        assert cause in sign.causes
    assert degenerate_start(_samples(["7"] * 19 + ["8"])) is None  # two answers: it reads its prompts
    assert degenerate_start(_samples(["7"] * 20, [0.0] * 19 + [1.0])) is None  # right for one: a weak model
    assert degenerate_start(_samples(["7"] * 4)) is None  # too few rows to tell
    assert degenerate_start([]) is None  # no samples recorded
    different = [s | {"transcript": f"{s['prompt']} -> tool -> DONE"} for s in _samples(["DONE"] * 20)]
    assert degenerate_start(different) is None  # multi-turn: the transcripts differ


def test_no_reward_is_a_stretch_of_at_least_64_rollouts_that_all_earned_the_same_nothing():
    nothing = {"reward/mean": 0.0, "reward/std": 0.0, "reward/max": 0.0, "reward/min": 0.0, "reward/count": 64.0}
    sign = no_reward(3, {3: nothing})
    assert sign is not None and sign.stops and sign.iteration == 3
    assert sign.seen.startswith("no sample of iteration 3 earned any reward: all 64 rollouts scored 0")
    assert "column" in sign.causes and "format" in sign.causes and "tokenization" in sign.causes
    small = nothing | {"reward/count": 32.0}  # a small batch can miss by chance: one is not enough
    assert no_reward(3, {3: small}) is None
    two = no_reward(3, {2: small, 3: small})
    assert two is not None and two.seen.startswith("no sample of iteration 3 earned any reward, nor of the 1 before")
    assert no_reward(3, {1: small, 2: small | {"reward/max": 1.0, "reward/std": 0.4}, 3: small}) is None
    assert no_reward(3, {3: nothing | {"reward/max": -1.0}}) is not None  # a penalty for every sample
    assert no_reward(3, {3: nothing | {"reward/std": 0.4, "reward/max": 1.0}}) is None
    assert no_reward(3, {3: nothing | {"reward/max": 1.0}}) is None  # every sample right: no stop
    assert no_reward(3, {3: nothing | {"reward/std": 0.2}}) is None  # penalties that differ still teach
    assert no_reward(0, {0: {"warm_start/accuracy": 0.4}}) is None  # the warm start's commit has no rewards


def test_the_collapse_in_the_issue_is_named_sign_by_sign_with_what_to_try():
    """Held-out 0.305 -> 0.140, entropy 1.13 -> 0.52, every answer alike (no group with spread)."""
    iterations = {
        i: {"reward/mean": r, "policy/entropy": e, "groups/zero_variance_fraction": z}
        for i, r, e, z in [(1, 0.30, 1.13, 0.40), (2, 0.25, 0.95, 0.70), (3, 0.18, 0.80, 0.92),
                           (4, 0.15, 0.61, 0.95), (5, 0.14, 0.52, 0.97)]
    }  # fmt: skip
    evals = {0: 0.305, 3: 0.190, 5: 0.140}
    signs = collapse_signs(iterations, evals)
    assert [s.name for s in signs] == ["accuracy_fell", "entropy_fell", "no_spread"]
    assert not any(s.stops for s in signs)
    assert "from 0.305 at iteration 0 to 0.190 at 3, 0.140 at 5" in signs[0].seen
    assert "from 1.130 (iteration 1) to 0.520 (iteration 5)" in signs[1].seen
    for remedy in ("trainer.lr", "rollout.samples_per_prompt", "algorithm.kl_coef", "trainer.epochs"):
        assert all(remedy in s.remedy for s in signs)


def test_each_collapse_sign_needs_its_whole_pattern():
    assert accuracy_fell({0: 0.305, 5: 0.140}) is None  # one eval after the start may be unlucky
    assert accuracy_fell({0: 0.305, 5: 0.25, 10: 0.14}) is None  # 0.25 is above both lines (0.205)
    assert accuracy_fell({0: 0.05, 5: 0.0, 10: 0.0}) is None  # a start of 0.05 cannot fall by 0.1
    assert accuracy_fell({0: 0.8, 5: 0.55, 10: 0.5}) is not None  # below 0.7 and below 0.6
    assert accuracy_fell({0: 0.8, 5: 0.65, 10: 0.5}) is None  # 0.65: below 0.7, not below 0.6
    learning = {1: {"policy/entropy": 1.0, "reward/mean": 0.2}, 9: {"policy/entropy": 0.3, "reward/mean": 0.7}}
    assert entropy_fell(learning) is None  # sharper and more rewarded: learning
    assert entropy_fell({1: {"policy/entropy": 1.0, "reward/mean": 0.2}}) is None
    solved = {i: {"groups/zero_variance_fraction": 0.95, "reward/mean": 0.5 + 0.1 * i} for i in range(1, 5)}
    assert no_spread(solved) is None  # groups all right once the reward rose: a learned task
    flat = {i: {"groups/zero_variance_fraction": 0.95, "reward/mean": 0.02} for i in range(1, 5)}
    assert no_spread(flat) is not None and no_spread({i: flat[i] for i in (1, 2)}) is None


def test_the_demo_names_nothing():
    assert collapse_signs(DEMO_ITERATIONS, DEMO_EVALS) == []
    assert not any(no_reward(i, DEMO_ITERATIONS) for i in DEMO_ITERATIONS)
    answers = ["74", "158", "99", "102", "80", "100", "113", "47"]  # the first of its iteration-0 answers
    assert degenerate_start(_samples(answers, [1.0, 1.0, 0, 0, 0, 0, 0, 0])) is None


def test_the_progress_display_says_each_collapse_sign_once_with_what_to_try():
    from rlpipe.pipelines.local_runner.progress import Progress

    progress = Progress(total=10)
    progress.iterations = {
        i: {"reward/mean": 0.02, "policy/entropy": 1.0 - 0.1 * i, "groups/zero_variance_fraction": 0.95}
        for i in range(1, 4)
    }
    printed: dict[str, int] = {}
    lines = progress.new_lines(printed)
    assert "  sign at iteration 3: most groups have no reward spread in iterations 1..3" in "\n".join(lines)
    assert any(line.startswith("    try: more rollout.samples_per_prompt") for line in lines)
    assert progress.new_lines(printed) == []  # said once
    progress.render()  # the terminal's table shows it too


def test_a_degenerate_start_stops_the_loop_at_iteration_0_and_the_report_and_status_name_it(
    tmp_path: Path,
):
    from rlpipe import loop
    from rlpipe.commands.status import describe, run_status
    from rlpipe.pipelines.local_runner.driver import how_it_ended
    from rlpipe.pipelines.local_runner.step_forks import StepLaunches
    from rlpipe.reports import eval_report
    from rlpipe.store.run_root import read_eval_samples, read_state
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = initialized(tmp_path, loop={"stop_on_signs": True})
    loop.evaluate(spec, run_root, read_weight_ref(run_root, 0), 0, cache)
    assert len({s["completion"] for s in read_eval_samples(run_root, 0)}) == 1  # the tiny v0 answers "1111"
    stopped = read_state(run_root)["stopped"]
    assert stopped["sign"] == "degenerate_start" and stopped["iteration"] == 0 and stopped["weights_version"] == 0
    assert loop.plan(spec, run_root).todo == 0
    with pytest.raises(StoppedBySign, match="stopped the loop at iteration 0: every held-out answer"):
        loop.generate(spec, run_root, read_weight_ref(run_root, 0), 1, str(tmp_path / "rollouts.parquet"), cache)
    report = eval_report(run_root, 0)
    assert "### Signs that the run does not learn" in report and "The loop stopped here" in report
    assert "data.chat\\_template" in report  # Markdown-escaped
    said = describe(run_status(run_root))
    assert "stopped     at iteration 0: every held-out answer at iteration 0 is the same string" in said
    assert "likely causes: the prompt's tokenization" in said and "start a new run" in said
    ended = "\n".join(how_it_ended(spec, run_root, read_state(run_root), StepLaunches()))
    assert ended.startswith("rlpipe stopped the loop at iteration 0") and f"or delete {run_root}" in ended


def test_a_reward_that_is_always_0_stops_the_loop_once_64_rollouts_earned_nothing(tmp_path: Path):
    from rlpipe import loop
    from rlpipe.commands.status import describe, run_status
    from rlpipe.store.run_root import read_state
    from rlpipe.store.weights import read_weight_ref

    spec, run_root, cache = initialized(
        tmp_path, reward={"functions": ["tests.toy_plugins:nothing"]}, loop={"stop_on_signs": True}
    )
    work = [tmp_path / f"work{i}" for i in (1, 2, 3)]
    for each in work:
        each.mkdir()
    weights, metrics = loop.run_iteration(spec, run_root, read_weight_ref(run_root, 0), 1, work[0], cache)
    assert metrics["reward/max"] == 0.0 and metrics["reward/count"] == 32.0  # 8 prompts x 4: not yet 64
    assert "stopped" not in read_state(run_root)
    weights, _ = loop.run_iteration(spec, run_root, weights, 2, work[1], cache)
    state = read_state(run_root)
    assert state["iteration"] == 2  # the iteration is committed; the loop ends after it
    assert state["stopped"]["sign"] == "no_reward" and state["stopped"]["iteration"] == 2
    assert state["stopped"]["reason"].startswith("no sample of iteration 2 earned any reward, nor of the 1 before")
    assert loop.plan(spec, run_root).todo == 0
    with pytest.raises(StoppedBySign, match="no sample of iteration 2 earned any reward"):
        loop.run_iteration(spec, run_root, weights, 3, work[2], cache)
    assert read_state(run_root)["iteration"] == 2
    said = describe(run_status(run_root))
    assert "stopped     at iteration 2: no sample of iteration 2 earned any reward" in said
    assert "likely causes: the reward reads the wrong column" in said


def test_the_stops_are_off_with_loop_stop_on_signs_false(tmp_path: Path):
    from rlpipe.spec import parse_spec
    from rlpipe.store.run_root import iteration_metrics_uri, write_json

    write_json(iteration_metrics_uri(str(tmp_path), 1), {"reward/std": 0.0, "reward/max": 0.0, "reward/count": 64.0})
    off, on = (parse_spec({"name": "t", "loop": {"stop_on_signs": enabled}}) for enabled in (False, True))
    assert should_stop(off, str(tmp_path), 1, 1) is None
    assert should_stop(on, str(tmp_path), 1, 1).sign == "no_reward"
