"""When the loop stops, decided in one place: one record (`Stop`) and one function (`should_stop`) that
the loop calls once at each step boundary that leaves records a stop reads:

    after the commit of iteration N (rlpipe.loop.sync_weights)   should_stop(spec, run_root, N, version)
    after the eval of iteration N   (rlpipe.loop.evaluate)        should_stop(..., evaluated=its metrics)

It checks, in this order, and the first that holds is the stop:

    1. a degenerate start  iteration 0's held-out greedy answers are one string, right for no row
                           (rlpipe.evaluation.diagnosis.degenerate_start)                 after the eval
    2. no reward           iteration N ends a stretch of >= 64 rollouts, none of which earned reward
                           (rlpipe.evaluation.diagnosis.no_reward)                        after the commit
    3. the eval gate       the eval's metrics pass loop.stop_when ("eval/accuracy_greedy >= 0.7")
                                                                                          after the eval

1 and 2 are signs that the run does not learn (loop.stop_on_signs: false checks neither). A stop is
recorded in state.json under `stopped` (`record_stop`, through rlpipe.store.commit). A sign's holds for
good: its cause lies in the spec, the data or the model, which a resumed run keeps. The gate's holds while
the spec keeps that gate (changing or removing loop.stop_when lets a stopped run go on). What holds
(`stopped`) is what `plan` asks (nothing left to do), what the generate step asks (StoppedBySign after a
sign) and what `rlpipe run` says last (`Stop.message`). Torch-free.
"""

from __future__ import annotations

import operator
import re
from dataclasses import asdict, dataclass

from rlpipe.evaluation.diagnosis import STOPPING, Sign, degenerate_start, no_reward, rewardless
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import iteration_metrics_uri, read_eval_samples, read_json, read_state


@dataclass(frozen=True)
class Stop:
    """Why the loop stopped and where: state.json's `stopped` (these fields, those left None omitted)."""

    iteration: int  # whose records showed it
    weights_version: int  # the version the loop ends on
    reason: str  # what was seen: "eval/accuracy_greedy 0.72 >= 0.7", or a sign's finding
    sign: str | None = None  # a sign's name (rlpipe.evaluation.diagnosis.STOPPING); None for the gate
    causes: str | None = None  # a sign's likely causes
    remedy: str | None = None  # and what to try
    when: str | None = None  # the eval gate that passed (loop.stop_when); None for a sign

    @classmethod
    def of_sign(cls, sign: Sign, weights_version: int) -> Stop:
        return cls(sign.iteration, weights_version, sign.seen, sign.name, sign.causes, sign.remedy)

    def record(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}

    def holds(self, spec: RunSpec) -> bool:
        return self.sign in STOPPING or bool(spec.loop.stop_when and self.when == spec.loop.stop_when)

    def message(self, run_root: str) -> str:
        """What `rlpipe run` says last, and a refused step: what was seen and, for a sign, why and what to do."""
        if self.sign is None:
            return f"loop.stop_when passed at iteration {self.iteration} ({self.reason}): the loop ends there"
        return (
            f"rlpipe stopped the loop at iteration {self.iteration}: {self.reason}\n"
            f"  likely causes: {self.causes}\n"
            f"  try: {self.remedy}\n"
            f"  then start a new run (another name or --run-dir, or delete {run_root}): a resumed run keeps the "
            f"spec and data that caused it. loop.stop_on_signs: false in a new run trains on through it."
        )


def should_stop(
    spec: RunSpec, run_root: str, iteration: int, weights_version: int, evaluated: dict[str, float] | None = None
) -> Stop | None:
    """The stop that iteration N's new records show, checked in the module's order, or None. `evaluated`:
    the metrics of N's eval, at the eval's boundary; None at the commit's."""
    signs: list[Sign | None] = []
    if spec.loop.stop_on_signs:
        if evaluated is not None and iteration == 0:
            signs.append(degenerate_start(read_eval_samples(run_root, 0)))
        if evaluated is None:
            signs.append(no_reward(iteration, rewardless_stretch(run_root, iteration)))
    for sign in signs:
        if sign is not None and sign.stops:
            return Stop.of_sign(sign, weights_version)
    if evaluated is not None and (reason := gate_passed(spec, evaluated)) is not None:
        return Stop(iteration, weights_version, reason, when=spec.loop.stop_when)
    return None


def record_stop(run_root: str, stop: Stop | None) -> None:
    """state.json records `stop` (none: nothing changes)."""
    if stop is not None:
        from rlpipe.store.commit import record_stopped

        record_stopped(run_root, stop.record())


def recorded_stop(state: dict) -> Stop | None:
    """The stop state.json records, whether or not it still holds."""
    return Stop(**state["stopped"]) if state.get("stopped") else None


def stopped(spec: RunSpec, state: dict) -> Stop | None:
    """The stop state.json records, while it holds (Stop.holds)."""
    stop = recorded_stop(state)
    return stop if stop is not None and stop.holds(spec) else None


class StoppedBySign(RuntimeError):
    """The loop stopped at a degenerate start or a no-reward iteration; the message says why and what to do."""


def refuse_if_stopped(run_root: str) -> None:
    """Raise StoppedBySign when a sign stopped the loop (a step that would start another iteration)."""
    stop = recorded_stop(read_state(run_root) or {})
    if stop is not None and stop.sign in STOPPING:
        raise StoppedBySign(stop.message(run_root))


def rewardless_stretch(run_root: str, iteration: int) -> dict[int, dict[str, float]]:
    """Iteration N's metrics and those before it, back to the last iteration with any reward."""
    stretch: dict[int, dict[str, float]] = {}
    while (metrics := read_json(iteration_metrics_uri(run_root, iteration - len(stretch)))) and rewardless(metrics):
        stretch[iteration - len(stretch)] = metrics
    return stretch


# --- the eval gate: loop.stop_when --------------------------------------------------------------

GATE_OPERATORS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def parse_gate(stop_when: str) -> tuple[str, str, float]:
    """loop.stop_when's (metric, operator, threshold): "eval/accuracy_greedy >= 0.7"."""
    gate = re.fullmatch(r"\s*(\S+?)\s*(>=|<=|>|<)\s*(\S+)\s*", stop_when)
    assert gate is not None  # parse_spec checked loop.stop_when against a narrower pattern
    name, op, threshold = gate.groups()
    return name, op, float(threshold)


def gate_passed(spec: RunSpec, evaluated: dict[str, float]) -> str | None:
    """Why the loop stops after an eval with metrics `evaluated` (loop.stop_when holds), or None."""
    if not spec.loop.stop_when:
        return None
    name, op, threshold = parse_gate(spec.loop.stop_when)
    if name not in evaluated:
        return None
    value = evaluated[name]
    return f"{name} {value:.4g} {op} {threshold:g}" if GATE_OPERATORS[op](value, threshold) else None
