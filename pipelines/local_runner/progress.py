"""What `rlpipe run` shows while it drives the loop: a live table on a terminal, else a line per committed
iteration, held-out eval, collapse sign and, once, how the KFP tasks started when some were not forks;
refreshed each second from the run root's metrics files and the KFP log's task markers."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table
from rich.text import Text

from rlpipe.evaluation.diagnosis import collapse_signs
from rlpipe.metric_keys import (
    CLIP_FRACTION,
    ENTROPY,
    EVAL_ACCURACY,
    GENERATE_TOKENS_PER_S,
    ITERATION_OVERHEAD,
    ITERATION_WALL,
    KL_MEAN,
    POLICY_LOSS,
    REWARD_MEAN,
    REWARD_STD,
    ZERO_VARIANCE_GROUPS,
)
from rlpipe.pipelines.local_runner.step_forks import StepLaunches
from rlpipe.store.run_root import list_metrics, read_state


@dataclass
class Progress:
    """What the display shows, refreshed from the run root's metrics files."""

    total: int
    iteration: int = 0
    task: str = "starting"
    latest: dict[str, float] = field(default_factory=dict)
    iterations: dict[int, dict[str, float]] = field(default_factory=dict)
    evals: dict[int, float] = field(default_factory=dict)
    launches: StepLaunches = field(default_factory=StepLaunches)  # how the KFP tasks started
    started: float = field(default_factory=time.time)

    def refresh(self, run_root: str, log_path: Path) -> None:
        state = read_state(run_root) or {}
        self.iteration = state.get("iteration", 0)
        self.iterations = {i: m for i, m in list_metrics(run_root, "iter").items() if i <= self.iteration}
        if self.iterations:
            self.latest = self.iterations[max(self.iterations)]
        self.evals = {i: m[EVAL_ACCURACY] for i, m in list_metrics(run_root, "eval").items()}
        if log_path.exists():
            with log_path.open("rb") as f:
                f.seek(max(0, log_path.stat().st_size - 8192))
                tasks = re.findall(rb"Executing task \x1b\[\d+m'([\w-]+)'", f.read())
            if tasks:
                self.task = tasks[-1].decode()

    def render(self) -> Table:
        table = Table.grid(padding=(0, 2))
        done = self.iteration / max(self.total, 1)
        bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
        table.add_row("iteration", f"[{bar}] {self.iteration}/{self.total}   step: {self.task}")
        m = self.latest
        if m:
            table.add_row(
                "reward",
                f"mean {m.get(REWARD_MEAN, 0):.3f}  std {m.get(REWARD_STD, 0):.3f}  "
                f"zero-variance groups {m.get(ZERO_VARIANCE_GROUPS, 0):.2f}",
            )
            table.add_row(
                "policy",
                f"loss {m.get(POLICY_LOSS, 0):+.4f}  kl {m.get(KL_MEAN, 0):.4f}  "
                f"entropy {m.get(ENTROPY, 0):.3f}  clip {m.get(CLIP_FRACTION, 0):.3f}",
            )
            table.add_row(
                "time",
                f"iteration {m.get(ITERATION_WALL, 0):.1f}s (orchestration "
                f"{m.get(ITERATION_OVERHEAD, 0):.1f}s)  "
                f"generate {m.get(GENERATE_TOKENS_PER_S, 0):.0f} tok/s",
            )
        if self.evals:
            first, last = min(self.evals), max(self.evals)
            table.add_row(
                "eval",
                f"greedy accuracy {self.evals[first]:.3f} (iteration {first}) -> "
                f"{self.evals[last]:.3f} (iteration {last})",
            )
        for sign in collapse_signs(self.iterations, self.evals):  # named, the loop goes on
            table.add_row("sign", Text(f"{sign.seen}\ntry: {sign.remedy}"))
        steps = self.launches.summary()
        table.add_row("steps", Text(steps, style="yellow" if self.launches.fresh else ""))
        table.add_row("elapsed", f"{time.time() - self.started:.0f}s")
        return table

    def new_lines(self, printed: dict[str, int]) -> list[str]:
        """The plain-text display (no terminal): a line per newly committed iteration, one per new held-out
        eval, and each collapse sign (rlpipe.evaluation.diagnosis) with what to try; `printed` remembers what
        was said, so each is said once; and, once, that tasks start as KFP starts them, with why."""
        lines = []
        for i in sorted(i for i in self.iterations if i > printed.get("iteration", -1)):
            printed["iteration"] = i
            m = self.iterations[i]
            text = f"iteration {i}/{self.total}"
            if i > 0:
                text += f"  reward {m.get(REWARD_MEAN, 0):.3f}  {m.get(ITERATION_WALL, 0):.1f}s"
            lines.append(text)
        for i in sorted(i for i in self.evals if i > printed.get("eval", -1)):
            printed["eval"] = i
            lines.append(f"  held-out greedy accuracy {self.evals[i]:.3f} (iteration {i})")
        for sign in collapse_signs(self.iterations, self.evals):
            if sign.name not in printed:  # each sign said once, when first seen
                printed[sign.name] = sign.iteration
                lines += [f"  sign at iteration {sign.iteration}: {sign.seen}", f"    try: {sign.remedy}"]
        if self.launches.fresh and "steps" not in printed:
            printed["steps"] = 1
            lines.append(f"  steps: {self.launches.summary()}")
        return lines
