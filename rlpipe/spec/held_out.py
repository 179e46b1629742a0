"""The held-out evaluation sections (rlpipe.evaluation.accuracy): what each eval measures beyond greedy accuracy,
and named held-out sets beside the data section's."""

from __future__ import annotations

from typing import Any

from rlpipe.spec.section import section, setting


@section
class EvalSetSpec:
    """A named held-out set beside the data section's (evaluation.sets): its own rows, verifier and cadence.
    Its metrics are eval/<name>/accuracy_greedy, eval/<name>/pass_at_k, ..."""

    name: str = setting(pattern=r"^[a-z0-9_]+$", doc="Names its metrics: eval/<name>/...")
    path: str | None = setting(default=None, doc="Rows from a file or saved dataset (data.path's formats and columns)")
    generator: str | None = setting(
        default=None, doc="Rows from a task generator (as data.generator), seeded apart from the training rows"
    )
    options: dict[str, Any] = setting(default_factory=dict, doc="The generator's options")
    size: int = setting(default=200, ge=1, doc="Rows at most")
    verifier: str | dict[str, Any] | None = setting(
        default=None, doc="Scores it (as reward.verifier; null: reward.verifier)"
    )
    every: int | None = setting(
        default=None,
        ge=1,
        doc="Evaluated at the evals (loop.eval_every) whose iteration is a multiple of this, and at the first and "
        "last (null: at every eval)",
    )
    samples: int | None = setting(default=None, ge=0, doc="k sampled completions per prompt (null: evaluation.samples)")

    def __post_init__(self) -> None:
        if (self.path is None) == (self.generator is None):
            raise ValueError(f"evaluation set {self.name!r} needs one of `path` (a file of rows) or `generator`")


@section
class HarnessSpec:
    """EleutherAI's lm-evaluation-harness on evaluated versions (rlpipe.evaluation.harness; the `harness` extra)."""

    tasks: list[str] = setting(
        min_length=1, doc="lm_eval task names: its registry's (they download their data) or include_path's"
    )
    include_path: str | None = setting(
        default=None, doc="A directory of lm_eval task YAML files (a task on local files runs offline)"
    )
    every: int | None = setting(
        default=None,
        ge=1,
        doc="Run with the evals whose iteration is a multiple of this, and the last (null: the last only)",
    )
    limit: int | None = setting(default=None, ge=1, doc="Documents per task at most")
    num_fewshot: int | None = setting(default=None, ge=0, doc="Few-shot examples (null: each task's own)")
    batch_size: int = setting(default=16, ge=1, doc="lm_eval's batch size")
    max_gen_toks: int = setting(default=256, ge=1, doc="Tokens a generate_until task may produce at most")


@section
class EvaluationSpec:
    """What each held-out eval measures beyond greedy accuracy (rlpipe.evaluation.accuracy)."""

    samples: int = setting(
        default=0,
        ge=0,
        doc="k: completions sampled per held-out prompt at `temperature`, beside the greedy one: eval/mean_at_k "
        "(the verifier's mean), eval/pass_at_j for j = 1, 2, 4, .., k (unbiased: 1 - C(k-c, j) / C(k, j), c of "
        "k correct), eval/maj_at_k (the majority answer's score). 0: greedy accuracy only",
    )
    temperature: float = setting(default=1.0, gt=0, doc="Of the sampled completions")
    sets: list[EvalSetSpec] = setting(
        default_factory=list, doc="More held-out sets, each named, with its own rows, verifier and cadence"
    )
    harness: HarnessSpec | None = setting(
        default=None, doc="lm-evaluation-harness tasks run with the evals: metrics harness/<task>/<metric>"
    )

    def __post_init__(self) -> None:
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"evaluation.sets names must differ: {names}")
