from kfp import dsl

from rlpipe.components import STEP_IMAGE


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
def track(spec: dict, run_root: str, status: dsl.PipelineTaskFinalStatus) -> str:
    """Exit task: log every committed iteration's metrics that MLflow lacks, even when an
    iteration failed (what was committed is kept). Returns the MLflow run id."""
    from rlpipe.spec import parse_spec
    from rlpipe.tracking import flush_metrics

    run_id, logged = flush_metrics(parse_spec(spec), run_root)
    print(f"MLflow run {run_id}: logged {logged} new points; pipeline {status.state}")
    return run_id
