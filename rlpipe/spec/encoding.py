"""The spec's other forms: a YAML file read (`load_spec`, with dotted `--set` overrides), plain dicts
(spec.json, MLflow params, the resident trainer's requests) and the JSON string that crosses KFP,
`parse_spec(spec_to_dict(spec)) == spec` and `spec_from_json(spec_to_json(spec)) == spec`; and what
the keys affect, decided here once: the settings an update computes with (TRAINING_KEYS), those free
to change when a run resumes (RESUMABLE_KEYS, checked by `resume_changes`) and those that make v0
(WARM_START_KEYS), selected by `pick` and `without`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rlpipe.spec.run_spec import RunSpec
from rlpipe.spec.validation import SpecError, parse_spec


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> RunSpec:
    """Read and validate a YAML run spec; `overrides` maps dotted keys to values."""
    import yaml  # not at the top: the steps parse dicts and need not pay for it

    path = Path(path)
    if not path.exists():
        raise SpecError(f"run spec {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise SpecError(f"run spec {path} is not valid YAML: {err}") from None
    return parse_spec(with_overrides(data, overrides or {}), str(path))


def with_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`data` (a spec as a dict, changed in place) with `overrides`' dotted keys set; a section that is
    absent or null (`harness: null`) is created. SpecError when a key on the way holds a value, not a section."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for i, part in enumerate(parents):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                key = ".".join(parents[: i + 1])
                raise SpecError(
                    f"--set {dotted}: {key} is {json.dumps(node, default=str)}, not a section; set it whole, "
                    f"e.g. --set '{key}={json.dumps(node, default=str)}'"
                )
        node[leaf] = value
    return data


def section_dict(section_value: Any) -> dict[str, Any]:
    """A section as a plain dict (tuples as lists), None values kept."""
    return _plain(dataclasses.asdict(section_value))


def spec_to_dict(spec: RunSpec) -> dict[str, Any]:
    """Every field as plain JSON-able values (tuples as lists), explicit nulls kept: what spec.json,
    MLflow and the resident trainer's requests hold. `parse_spec(spec_to_dict(spec)) == spec`."""
    return _plain(dataclasses.asdict(spec))


def spec_to_json(spec: RunSpec) -> str:
    """The spec as one JSON string: the `spec` parameter of every KFP component and pipeline.

    A string crosses KFP unchanged, where a dict parameter (a protobuf Struct) cannot hold null and
    turns every int into a double; JSON keeps nulls, ints, floats and lists exactly."""
    return json.dumps(spec_to_dict(spec), sort_keys=True, allow_nan=False)


def spec_from_json(text: str, source: str = "the spec parameter") -> RunSpec:
    """The RunSpec a step receives as its `spec` parameter (`spec_to_json`)."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise SpecError(f"{source} is not a run spec's JSON ({err}); pass rlpipe.spec.spec_to_json(spec)") from None
    return parse_spec(data, source)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1} (MLflow params)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


# Dotted keys; a section name covers the section.
# what an update computes with (loop.max_staleness: the default off_policy_correction)
TRAINING_KEYS = ("seed", "model", "rollout", "algorithm", "trainer", "loop.max_staleness")
# free to change when a run resumes: how far it goes, where it stores, how steps are placed and where
# rollouts and updates are computed (every engine samples the same policy; the resident trainer
# computes the per-step update)
RESUMABLE_KEYS = (
    "loop",
    "storage",
    "cluster",
    "samplers",
    "rollout.engine",
    "trainer.resident",
    "trainer.endpoint",
    "trainer.device",  # where it computes; the update is the same up to float rounding
    "trainer.threads",
    "trainer.micro_batch_tokens",  # the same update, accumulated in parts
    "trainer.gradient_checkpointing",
    "trainer.padding_free",  # the same update, its rows packed (to float rounding)
    "trainer.logit_chunk_tokens",  # the same log-probs, computed in parts
    "trainer.gpus",  # the same update, sharded (to float rounding)
    "trainer.nodes",
    "tracking.register",  # which evaluated versions the registry gets from now on
    "tracking.registered_model",
    "tracking.model_registry",  # a Kubeflow registry added later gets the versions the store still has
    "reward.timeout_s",  # how long a reward may take, not what it returns
    "evaluation",  # what the held-out evals measure (a set added on resume is prepared then)
)
WARM_START_KEYS = (  # what makes v0
    "seed",
    "model",
    "data",
    "reward.verifier",
    "rollout.max_new_tokens",
    "rollout.environment",
)


def resume_changes(stored: dict[str, Any], new: RunSpec) -> list[tuple[str, Any, Any]]:
    """(dotted key, stored value, new value) of each setting outside RESUMABLE_KEYS that `new` changes
    against the spec a run was started with (its spec.json): a resumed run must keep them.

    The stored spec is parsed first, so what is compared is what each spec means: defaults filled
    in, `7` equal to `7.0`, lists equal to tuples."""
    try:
        stored = spec_to_dict(parse_spec(stored, "the stored spec.json"))
    except SpecError:
        pass  # written by an older rlpipe that accepted other keys: compare it as written
    before = flatten(without(stored, RESUMABLE_KEYS))
    after = flatten(without(spec_to_dict(new), RESUMABLE_KEYS))
    missing = object()
    return [
        (key, before.get(key), after.get(key))
        for key in sorted(set(before) | set(after))
        if before.get(key, missing) != after.get(key, missing)
    ]


def pick(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """{dotted key: its value in `data`} for `keys` (absent keys: None)."""
    picked = {}
    for key in keys:
        node: Any = data
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        picked[key] = node
    return picked


def without(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """`data` (nested) without the dotted `keys`."""
    kept = {k: v for k, v in data.items() if k not in keys}
    for key in keys:
        section, _, rest = key.partition(".")
        if rest and isinstance(kept.get(section), dict):
            kept[section] = without(kept[section], (rest,))
    return kept
