"""The `algorithm` section: `name` picks a registered algorithm, and the section's other keys are that
algorithm's options (as prime-rl keys its loss config on `type`).

`AlgorithmSpec` holds the options every algorithm takes; each algorithm's own are a subclass of it declared
beside the algorithm (rlpipe.algorithms.grpo's `GrpoOptions`, ...) and registered with it
(rlpipe.algorithms.register_algorithm calls `register_options`), so adding an algorithm never touches this
package, and this package imports none. `parse_spec` builds the section as the class the name registers
(`AlgorithmSpec.variant`): the built-in algorithms are found as a user's plugin is, by plugin discovery
(rlpipe.plugins.discover_built_ins imports the module that registers them, then, never when rlpipe.spec is).

A null option means the algorithm's default, as in the flat section older rlpipe wrote (every option of
every algorithm, most null): those specs still parse, and a key the algorithm does not take is refused with
the algorithm's options and the algorithms that take it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

from rlpipe.spec.migration import FLAT_ALGORITHM_DEFAULTS
from rlpipe.spec.section import section, setting

DEFAULT = "grpo"


@section
class AlgorithmSpec:
    """The RL algorithm (advantages and loss) and its options: those below, which every algorithm takes, then
    its own (the tables after this one, docs/algorithms.md). Null: the algorithm's default."""

    name: str = setting(
        default=DEFAULT,
        doc="A registered algorithm (rlpipe.algorithms), or 'package.module:name' for one that module registers",
    )
    kl_coef: float = setting(
        default=0.0,
        ge=0,
        doc="The KL penalty coefficient: the weight of the estimated KL to the frozen reference (v0) in the loss "
        "(reinforce_pp: in the per-token reward, subtracted after the outcome is whitened, where the paper whitens "
        "both: docs/algorithms.md; dpo, online_dpo: refused, DPO's temperature is their pull to it). 0: no penalty",
    )
    entropy_coef: float = setting(default=0.0, ge=0, doc="Entropy bonus: the loss minus this x the mean token entropy")
    track_reference_kl: bool = setting(
        default=True, doc="Log kl/mean to v0 even when kl_coef is 0 (estimated on each iteration's first micro-batch)"
    )
    off_policy_correction: Literal["none", "truncate", "mask"] | None = setting(
        default=None,
        doc="Importance weight pi_prox / pi_behaviour for rollouts a different policy sampled (stale ones, "
        "loop.max_staleness >= 1; or a sampler's numerics): truncate it at is_threshold (TIS), or mask tokens "
        "outside [1/is_threshold, is_threshold] (MIS); both recompute pi_prox, the update's starting weights' "
        "log-probs. none: the clipped ratio to the behaviour log-probs, as a synchronous run. null: truncate "
        "when loop.max_staleness >= 1 (the ratio to a stale policy clips most of the signal away), else none",
    )
    is_threshold: float = setting(default=2.0, gt=1, doc="TIS's cap C on the importance weight; MIS keeps [1/C, C]")

    # What code serving any algorithm (the update, the prompt order, the KL check) reads of one without the
    # option: plain class attributes, no settings; an algorithm's options that have it declare it as a setting.
    # A type checker sees them as read-only attributes, which an algorithm's setting of a narrower type overrides.
    if TYPE_CHECKING:

        @property  # the update's aggregations (rlpipe.algorithms.policy_gradient.Aggregation)
        def loss_aggregation(self) -> Literal["sequence_mean", "token_mean", "sequence_sum"] | None: ...
        @property
        def length_norm(self) -> int | None: ...
        @property
        def kl_estimator(self) -> str | None: ...
        @property
        def critic_lr(self) -> float | None: ...
        @property
        def dynamic_sampling(self) -> bool: ...
        @property
        def max_oversample(self) -> float: ...

    else:
        loss_aggregation = None  # the update: "sequence_mean"
        length_norm = None
        kl_estimator = None  # no KL term in the loss
        critic_lr = None  # no critic
        dynamic_sampling = False  # no refill prompts
        max_oversample = 1.0

    @classmethod
    def variant(cls, data: dict[str, Any]) -> tuple[type[AlgorithmSpec], dict[str, Any]]:
        """(the options class of the algorithm `data` names, the keys to build it from): nulls dropped (the
        algorithm's default), as the flat section's keys at their defaults. ValueError names a key it lacks."""
        name = data.get("name", DEFAULT)
        options = options_class(name) if isinstance(name, str) else AlgorithmSpec
        keys = {f.name for f in dataclasses.fields(options)}
        kept = {
            key: value
            for key, value in data.items()
            if value is not None
            and (key in keys or key not in FLAT_ALGORITHM_DEFAULTS or FLAT_ALGORITHM_DEFAULTS[key] != value)
        }
        if unread := sorted(set(kept) - keys, key=str):
            raise ValueError("\n  ".join(not_an_option(key, name, options) for key in unread))
        return options, kept


OPTIONS: dict[str, type[AlgorithmSpec]] = {}  # each registered algorithm's options section, by its name


def register_options(name: str, options: type[AlgorithmSpec]) -> None:
    """Algorithm `name` takes `options` (rlpipe.algorithms.register_algorithm registers both)."""
    OPTIONS[name] = options


def options_class(name: str) -> type[AlgorithmSpec]:
    """The options section algorithm `name` ('grpo', or 'package.module:name') registers; ValueError names what
    is registered."""
    from rlpipe.plugins import discover_built_ins, look_up  # when a spec is parsed: importing the spec loads none

    discover_built_ins()
    return look_up(name, OPTIONS, "algorithm.name", "algorithm", "rlpipe.algorithms.register_algorithm")[1]


def options_classes() -> dict[str, type[AlgorithmSpec]]:
    """Every registered algorithm's options section, by name (the built-ins, and plugins imported so far)."""
    from rlpipe.plugins import discover_built_ins

    discover_built_ins()
    return dict(OPTIONS)


def own_options(options: type[AlgorithmSpec]) -> list[dataclasses.Field]:
    """The settings of an algorithm's options that are its own: not AlgorithmSpec's, or with another default."""
    common = {f.name: f for f in dataclasses.fields(AlgorithmSpec)}
    return [
        f
        for f in dataclasses.fields(options)
        if f.name != "name" and (f.name not in common or f.default != common[f.name].default)
    ]


def not_an_option(key: str, name: str, options: type[AlgorithmSpec]) -> str:
    """algorithm.<key> is not an option of algorithm <name>: its options, and which algorithms take the key."""
    own = ", ".join(f.name for f in own_options(options)) or "none beyond the common ones"
    takers = sorted(n for n, cls in options_classes().items() if key in {f.name for f in dataclasses.fields(cls)})
    instead = f"pick an algorithm that takes it ({', '.join(takers)})" if takers else "check its spelling"
    return f"algorithm.{key} is not an option of algorithm {name} (its options: {own}); remove it, or {instead}"


def default_algorithm() -> AlgorithmSpec:
    """The default algorithm's options at their defaults: RunSpec's `algorithm` when a spec gives none."""
    return options_class(DEFAULT)()
