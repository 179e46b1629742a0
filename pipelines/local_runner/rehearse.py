"""`rlpipe rehearse PIPELINE.yaml`: the file `rlpipe compile` wrote, run on this machine as it is.

What users upload in the KFP UI or submit with the SDK is the compiled IR YAML, not the Python that
made it. Here KFP's own loader reads that file (`kfp.components.load_component_from_file`) and KFP's
local runner executes it, driven by `rlpipe run`'s loop (rlpipe.pipelines.local_runner.driver): one pipeline
run per chunk until state.json says the loop is done, each task a fork of the warm step server, or
with `--containers` each task in the image the file names. A parameter the YAML drops or a step wired
differently from the Python pipeline shows up here, before a cluster runs it.

The file's own spec (its `spec` parameter's default) is run with what only a cluster has replaced:
    storage     the run root on this machine (`--run-dir`) and its default cache, instead of the PVC or bucket
    tracking    MLflow in the run root (tracking.uri null) instead of the cluster's server
    services    the resident trainer and the samplers started here (trainer.endpoint null,
                samplers.endpoints []): the cluster's Services do not resolve on this machine
and then the user's `--set`s. The PlatformSpec (PVCs, node selectors, secrets) is the cluster's alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlpipe.spec import RunSpec, SpecError, parse_spec
from rlpipe.spec.encoding import with_overrides

ON_THIS_MACHINE = {"storage.cache": None, "tracking.uri": None, "trainer.endpoint": None, "samplers.endpoints": []}


def load_compiled(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """(the pipeline as KFP loads it, its spec parameter's default as a dict) of a file `rlpipe compile` wrote."""
    from kfp import components

    path = Path(path)
    if not path.is_file():
        raise SpecError(f"pipeline file {path} does not exist; write one with: rlpipe compile SPEC -o {path}")
    try:
        pipeline = components.load_component_from_file(str(path))
    except Exception as err:  # noqa: BLE001 (KFP raises several kinds for a file it cannot read)
        raise SpecError(f"pipeline file {path} is not a pipeline KFP can load ({type(err).__name__}: {err})") from None
    inputs = pipeline.component_spec.inputs or {}
    if "spec" not in inputs or "run_root" not in inputs or inputs["spec"].default is None:
        raise SpecError(
            f"pipeline file {path} has no spec and run_root parameters with a default spec: rehearse a file "
            "`rlpipe compile SPEC -o FILE` wrote"
        )
    return pipeline, json.loads(inputs["spec"].default)


def local_spec(compiled: dict[str, Any], run_root: str, overrides: dict[str, Any], source: str) -> RunSpec:
    """The compiled spec as this machine runs it (see the module's docstring), then `overrides`."""
    here = ON_THIS_MACHINE | {"storage.root": str(Path(run_root).parent)}
    return parse_spec(with_overrides(compiled, here | overrides), source)
