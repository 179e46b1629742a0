"""Signs that a run does not learn, named from what it already records, with their likely causes and what
to try (docs/following-a-run.md, "When a run does not learn"):

    degenerate start  the iteration-0 eval's held-out greedy answers are one string, right for no row
                      (metrics/eval_000000_samples.jsonl)                                  -> the loop stops
    no reward         every sample of an iteration earned the same reward, none above 0
                      (reward/max and reward/std of metrics/iter_N.json)                   -> the loop stops
    collapse          held-out accuracy well below its start; entropy halved while the reward did not rise;
                      most groups without reward spread, iterations in a row               -> named, it goes on

The loop stops on the first two (rlpipe.evaluation.stopping, where the eval gate's stop is decided too): the
sign, its likely causes and what to try are recorded in state.json, `plan` then plans nothing and the
generate step refuses to start an iteration (StoppedBySign). The cause lies in the spec, the data or the
model, which a resumed run keeps: the way on is a new run. `loop.stop_on_signs: false` records no stop (the
test suite's tiny specs, which learn nothing by design; a reward so sparse that a first iteration may miss
it everywhere). Torch-free: the stopping module, the progress display and the reports call it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlpipe.metric_keys import (
    ENTROPY,
    EVAL_ACCURACY,
    REWARD_COUNT,
    REWARD_MAX,
    REWARD_MEAN,
    REWARD_STD,
    ZERO_VARIANCE_GROUPS,
)
from rlpipe.store.run_root import list_metrics, read_eval_samples

DEGENERATE_MIN_ROWS = 5  # fewer held-out rows can share one answer by chance
ACCURACY_DROP = 0.1  # below start - 0.1: past a 500-row held-out set's noise (std ~0.02 at accuracy 0.3)
ACCURACY_SHARE = 0.75  # and below 0.75 x start: a low start must lose a quarter of itself, not 0.1 absolute
ACCURACY_EVALS = 2  # the last 2 evals after the start both below: one unlucky eval is no collapse
ENTROPY_SHARE = 0.5  # below half the first iteration's entropy with no more reward: sharpened on nothing
NO_SPREAD_FRACTION = 0.9  # over 90% of groups with all-equal rewards: their group-relative advantage is 0
NO_SPREAD_ITERATIONS = 3  # in a row: one iteration of hard prompts is no trend
EQUAL = 1e-9  # a reward std this small: every reward is the same number
NO_REWARD_ROLLOUTS = 64  # in a row without reward: a policy right 5% of the time misses all 64 with p < 4%

STOPPING = ("degenerate_start", "no_reward")  # the signs that stop the loop; the collapse signs are named only

TOKENIZATION = "the prompt's tokenization (a missing BOS: `rlpipe check` prints the first prompt's tokens)"
COLLAPSE_REMEDY = (
    "a lower trainer.lr (~1e-6..5e-6 for 1B+ models, ~5e-5 for ~100M), more rollout.samples_per_prompt, "
    "a KL penalty to v0 (algorithm.kl_coef > 0), fewer trainer.epochs or trainer.mini_batches; "
    "`rlpipe fork RUN --from-iteration N --name NEW --set trainer.lr=...` goes on from a good version"
)


@dataclass(frozen=True)
class Sign:
    """A problem a run's records show: what was seen at which iteration, its likely causes, what to try."""

    name: str  # degenerate_start, no_reward (STOPPING), accuracy_fell, entropy_fell, no_spread
    iteration: int
    seen: str
    causes: str
    remedy: str

    @property
    def stops(self) -> bool:
        return self.name in STOPPING

    def lines(self) -> list[str]:
        return [self.seen, f"likely causes: {self.causes}", f"try: {self.remedy}"]


def degenerate_start(samples: list[dict]) -> Sign | None:
    """The iteration-0 eval's held-out rows (rlpipe.evaluation.accuracy.eval_samples records) all answered
    with one string (a multi-turn row: its transcript), which the verifier scores above 0 for none."""
    answers = {(s.get("transcript") or s["completion"]).strip() for s in samples}
    if len(samples) < DEGENERATE_MIN_ROWS or len(answers) != 1 or any(s["reward"] > 0 for s in samples):
        return None
    answer = samples[0].get("transcript") or samples[0]["completion"]  # as the model wrote it
    return Sign(
        "degenerate_start",
        0,
        f"every held-out answer at iteration 0 is the same string, {answer[:80]!r}, right for none of the "
        f"{len(samples)} rows: the model does not read its prompts",
        f"{TOKENIZATION}, the chat template (data.chat_template, data.system_prompt), or rollout.max_new_tokens "
        "too small for an answer",
        "compare the prompts and answers in the evaluate step's eval_samples report (metrics/eval_000000_samples"
        ".jsonl) with what the model should write; `rlpipe check SPEC` before the new run",
    )


def rewardless(metrics: dict[str, float]) -> bool:
    """Every sample of the iteration earned the same reward, none above 0 (the score step's metrics)."""
    return REWARD_MAX in metrics and REWARD_STD in metrics and metrics[REWARD_MAX] <= 0 and metrics[REWARD_STD] <= EQUAL


def no_reward(iteration: int, iterations: dict[int, dict[str, float]]) -> Sign | None:
    """The iterations through N in a row whose rollouts all earned the same reward, none above 0, at least
    NO_REWARD_ROLLOUTS rollouts among them (metrics/iter_N.json: reward/count): every group-relative
    advantage was 0, so the updates learned nothing, and not by the chance of a small batch."""
    stretch: list[dict[str, float]] = []
    while rewardless(iterations.get(iteration - len(stretch), {})):
        stretch.append(iterations[iteration - len(stretch)])
    rollouts = sum(m.get(REWARD_COUNT, 0.0) for m in stretch)
    if not stretch or rollouts < NO_REWARD_ROLLOUTS:
        return None
    since = "" if len(stretch) == 1 else f", nor of the {len(stretch) - 1} before it"
    score = stretch[0][REWARD_MAX]
    return Sign(
        "no_reward",
        iteration,
        f"no sample of iteration {iteration} earned any reward{since}: all {rollouts:.0f} rollouts scored {score:g} "
        f"({REWARD_MAX} {score:g}, {REWARD_STD} 0), so no group teaches anything",
        "the reward reads the wrong column (the built-in verifiers read `reference`; a verifier type its "
        "answer_column), the verifier expects another answer format than the model writes, "
        f"{TOKENIZATION}, or prompts too hard for the starting model",
        "compare the completions in the advantages step's rollout_samples report with the expected answers; "
        "call the reward on a few of them by hand",
    )


def accuracy_fell(evals: dict[int, float]) -> Sign | None:
    """Held-out greedy accuracy ({iteration: accuracy}) below both start - ACCURACY_DROP and
    ACCURACY_SHARE x start at each of the last ACCURACY_EVALS evals after the start."""
    if len(evals) < 1 + ACCURACY_EVALS:
        return None
    start = evals[min(evals)]
    line = min(start - ACCURACY_DROP, ACCURACY_SHARE * start)
    last = sorted(evals)[-ACCURACY_EVALS:]
    if any(evals[i] >= line for i in last):
        return None
    shown = ", ".join(f"{evals[i]:.3f} at {i}" for i in last)
    return Sign(
        "accuracy_fell",
        last[-1],
        f"held-out accuracy fell from {start:.3f} at iteration {min(evals)} to {shown}",
        "updates too large for the model: the policy left what it knew (collapse)",
        COLLAPSE_REMEDY,
    )


def entropy_fell(iterations: dict[int, dict[str, float]]) -> Sign | None:
    """The update's policy entropy (policy/entropy) below ENTROPY_SHARE x the first iteration's while the
    reward mean is not above the first iteration's (entropy falling as the reward rises is learning)."""
    measured = sorted(i for i, m in iterations.items() if ENTROPY in m and REWARD_MEAN in m)
    if len(measured) < 2:
        return None
    first, last = iterations[measured[0]], iterations[measured[-1]]
    if last[ENTROPY] >= ENTROPY_SHARE * first[ENTROPY] or last[REWARD_MEAN] > first[REWARD_MEAN]:
        return None
    return Sign(
        "entropy_fell",
        measured[-1],
        f"policy entropy fell from {first[ENTROPY]:.3f} (iteration {measured[0]}) to {last[ENTROPY]:.3f} "
        f"(iteration {measured[-1]}) while the reward mean did not rise ({first[REWARD_MEAN]:.3f} -> "
        f"{last[REWARD_MEAN]:.3f})",
        "the policy narrows onto a few answers that earn nothing more (collapse): steps too large, or groups "
        "too small to show a better answer",
        COLLAPSE_REMEDY,
    )


def no_spread(iterations: dict[int, dict[str, float]]) -> Sign | None:
    """Over NO_SPREAD_FRACTION of the groups without reward spread (groups/zero_variance_fraction) in each of
    the last NO_SPREAD_ITERATIONS iterations, the reward mean not above the first iteration's (groups that are
    all right, once the reward rose, are a learned task)."""
    recent = sorted(i for i, m in iterations.items() if ZERO_VARIANCE_GROUPS in m)[-NO_SPREAD_ITERATIONS:]
    spread = [iterations[i][ZERO_VARIANCE_GROUPS] for i in recent]
    if len(recent) < NO_SPREAD_ITERATIONS or min(spread) <= NO_SPREAD_FRACTION:
        return None
    rewarded = sorted(i for i, m in iterations.items() if REWARD_MEAN in m)
    first, last = iterations[rewarded[0]], iterations[recent[-1]]
    if last.get(REWARD_MEAN, 0.0) > first[REWARD_MEAN]:
        return None
    shares = ", ".join(f"{share:.2f}" for share in spread)
    return Sign(
        "no_spread",
        recent[-1],
        f"most groups have no reward spread in iterations {recent[0]}..{recent[-1]} ({shares} of them): their "
        "advantages are 0",
        "groups too small to hold both a right and a wrong answer, prompts too hard (or too easy) for the "
        "model, or a policy collapsed onto one answer per prompt",
        "more rollout.samples_per_prompt; prompts nearer the model's level; if the answers all look alike, "
        + COLLAPSE_REMEDY,
    )


def collapse_signs(iterations: dict[int, dict[str, float]], evals: dict[int, float]) -> list[Sign]:
    """The collapse signs that the iterations' metrics ({iteration: metrics/iter_N.json}) and the held-out
    greedy accuracies ({iteration: accuracy}) show, each named once; none stops the loop."""
    return [s for s in (accuracy_fell(evals), entropy_fell(iterations), no_spread(iterations)) if s is not None]


def signs_at(run_root: str, iteration: int) -> list[Sign]:
    """Every sign the run root's records show up to iteration N: a degenerate start (N = 0), a no-reward
    iteration N, and the collapse signs."""
    iterations = {i: m for i, m in list_metrics(run_root, "iter").items() if i <= iteration}
    evaluated = list_metrics(run_root, "eval")
    evals = {i: m[EVAL_ACCURACY] for i, m in evaluated.items() if i <= iteration and EVAL_ACCURACY in m}
    found = [degenerate_start(read_eval_samples(run_root, 0))] if iteration == 0 else []
    found.append(no_reward(iteration, iterations))
    return [s for s in found if s is not None] + collapse_signs(iterations, evals)
