"""Submit one run, or a recurring run, of the compiled pipeline to a KFP API server (kfp.Client).

Every run of the pipeline continues the loop from state.json on the cluster's storage and is a
no-op once the loop is done, so a recurring run keeps the RL loop going with no driver.

KFP 2.17's MLflow integration (KEP-12862) files each pipeline run's MLflow run under the experiment
the run or recurring run names in `plugins_input.mlflow.experiment_name`; both are sent with the
spec's tracking.experiment, so the pipeline runs land beside the RL run that rlpipe tracks
(rlpipe.tracking.mlflow_runs). kfp 2.17's Client has no parameter for plugins_input, so the run body is built
here as Client.run_pipeline / create_recurring_run build it (their job config), plugins_input added.
"""

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlpipe.pipelines.compile import compile_pipeline
from rlpipe.spec import RunSpec

_DURATION = re.compile(r"^(\d+)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass
class Submitted:
    id: str
    url: str
    state: str | None = None


def kfp_client(host: str, token: str | None = None):
    """kfp.Client for `host`; auth as kfp.Client does it: a bearer token (--token or
    KFP_BEARER_TOKEN), else its own credential discovery (kube config, in-cluster token)."""
    import kfp

    try:
        return kfp.Client(host=host, existing_token=token or os.environ.get("KFP_BEARER_TOKEN"))
    except Exception as err:  # kfp.Client health-checks the server at construction
        raise RuntimeError(
            f"cannot reach the KFP API at {host}: {type(err).__name__}. Check --host (the KFP UI/API URL, "
            "e.g. https://HOST/pipeline) and auth (--token or KFP_BEARER_TOKEN, or your kube config)"
        ) from None


def cron_for_kfp(expression: str) -> str:
    """KFP cron has a seconds field: '0 * * * *' (5 fields) becomes '0 0 * * * *'."""
    fields = expression.split()
    if len(fields) == 5:
        return f"0 {expression}"
    if len(fields) == 6:
        return expression
    raise ValueError(f"--cron {expression!r}: expected 5 fields (min hour day month weekday) or 6 (with seconds)")


def interval_seconds(duration: str) -> int:
    """'30m' -> 1800; units s, m, h, d."""
    match = _DURATION.match(duration.strip())
    if not match or int(match[1]) == 0:
        raise ValueError(f"--every {duration!r}: expected a positive number and a unit, e.g. 30m, 2h, 1d")
    return int(match[1]) * _SECONDS[match[2]]


def _compiled(spec: RunSpec, run_root: str | None, workdir: str) -> str:
    return str(compile_pipeline(spec, Path(workdir) / f"{spec.name}.yaml", run_root=run_root))


def _job_config(client, spec: RunSpec, run_root: str | None):
    """The compiled pipeline as kfp.Client puts it in a run body (pipeline_spec, runtime_config), caching off."""
    with tempfile.TemporaryDirectory() as workdir:
        return client._create_job_config(
            params={}, pipeline_package_path=_compiled(spec, run_root, workdir), pipeline_id=None,
            version_id=None, enable_caching=False, cache_key="", pipeline_root=None,
        )  # fmt: skip


def mlflow_plugin(experiment: str | None) -> dict | None:
    """plugins_input naming the MLflow experiment of the KFP run's MLflow run; None sends none (a KFP
    API server older than 2.17 may refuse the field)."""
    return {"mlflow": {"experiment_name": experiment}} if experiment else None


def submit_run(
    spec: RunSpec,
    host: str,
    experiment: str,
    run_root: str | None = None,
    wait_s: int | None = None,
    token: str | None = None,
    mlflow_experiment: str | None = None,
) -> Submitted:
    """One run: advances the loop by up to loop.iterations_per_run iterations."""
    import kfp_server_api

    client = kfp_client(host, token)
    experiment_id = client.create_experiment(experiment).experiment_id
    config = _job_config(client, spec, run_root)
    body = kfp_server_api.V2beta1Run(
        experiment_id=experiment_id,
        display_name=f"{spec.name}-run",
        pipeline_spec=config.pipeline_spec,
        runtime_config=config.runtime_config,
        plugins_input=mlflow_plugin(mlflow_experiment),
    )
    result = client._run_api.run_service_create_run(run=body)
    submitted = Submitted(result.run_id, f"{host.rstrip('/')}/#/runs/details/{result.run_id}")
    if wait_s:
        run = client.wait_for_run_completion(result.run_id, timeout=wait_s)
        submitted.state = str(run.state)
    return submitted


def schedule_run(
    spec: RunSpec,
    host: str,
    experiment: str,
    cron: str | None = None,
    every: str | None = None,
    run_root: str | None = None,
    token: str | None = None,
    mlflow_experiment: str | None = None,
) -> Submitted:
    """A recurring run: max_concurrency=1 (iterations never overlap), no catch-up of missed slots."""
    import kfp_server_api

    if (cron is None) == (every is None):
        raise ValueError("give exactly one of --cron EXPR or --every DURATION")
    cron_expression = cron_for_kfp(cron) if cron else None  # checked before any request
    every_s = interval_seconds(every) if every else None
    client = kfp_client(host, token)
    experiment_id = client.create_experiment(experiment).experiment_id
    config = _job_config(client, spec, run_root)
    if cron_expression is not None:
        trigger = kfp_server_api.V2beta1Trigger(cron_schedule=kfp_server_api.V2beta1CronSchedule(cron=cron_expression))
    else:
        schedule = kfp_server_api.V2beta1PeriodicSchedule(interval_second=every_s)
        trigger = kfp_server_api.V2beta1Trigger(periodic_schedule=schedule)
    body = kfp_server_api.V2beta1RecurringRun(
        experiment_id=experiment_id,
        mode=kfp_server_api.RecurringRunMode.ENABLE,
        pipeline_spec=config.pipeline_spec,
        runtime_config=config.runtime_config,
        display_name=f"{spec.name}-loop",
        description=f"rlpipe: continue {spec.name} by {spec.loop.iterations_per_run} iterations per run",
        no_catchup=True,
        trigger=trigger,
        max_concurrency=1,
        plugins_input=mlflow_plugin(mlflow_experiment),
    )
    recurring = client._recurring_run_api.recurring_run_service_create_recurring_run(recurring_run=body)
    return Submitted(
        recurring.recurring_run_id, f"{host.rstrip('/')}/#/recurringrun/details/{recurring.recurring_run_id}"
    )
