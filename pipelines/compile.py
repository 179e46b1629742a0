"""Compile the run pipeline to KFP IR YAML, with the spec and run root as parameter defaults."""

from pathlib import Path

from kfp import compiler

from rlpipe.run_store import run_root_for
from rlpipe.spec import RunSpec, spec_to_dict


def compile_pipeline(spec: RunSpec, output: str | Path, run_root: str | None = None) -> Path:
    """Write the K-iteration pipeline (K = loop.iterations_per_run); one run advances the loop by K.

    The run root must be storage every step can reach on the cluster (gs://..., or a path on
    the shared-FS PVC). The spec is a pipeline parameter, editable when creating a run.
    """
    from rlpipe.pipelines.rl_pipeline import build_run_pipeline

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(
        pipeline_func=build_run_pipeline(spec.loop.iterations_per_run),
        package_path=str(output),
        pipeline_parameters={
            "spec": spec_to_dict(spec),
            "run_root": run_root or run_root_for(spec.storage.root, spec.name),
        },
    )
    return output
