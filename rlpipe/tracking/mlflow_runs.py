"""MLflow tracking: one MLflow run per RL run, metrics at step = iteration, no duplicates; the
evaluated weight versions in the Model Registry; the spec and the eval samples as artifacts.

Metrics are first written to the run root (metrics/*.json, by sync_weights and evaluate);
`flush` copies every committed point MLflow does not yet have, registers the evaluated versions
tracking.register asks for (and, with tracking.model_registry, in the Kubeflow Model Registry too:
rlpipe.tracking.kubeflow_registry), and logs what the run's artifacts lack. MLflow is the record of what
was logged, so a flush killed halfway is simply repeated; a complete one records what it logged from in
tracked.json, and a flush finding the same returns without importing MLflow. The track step flushes at the
end of each pipeline run; `rlpipe run` also flushes as each iteration commits (`flush_as_it_commits`).

On a cluster with KFP 2.17's MLflow integration (KEP-12862) each pipeline run has an MLflow run of its
own and each task one nested under it; the launcher logs the tasks' Metrics artifacts and inputs
there. When a task sees the variables KFP injects (`kfp_mlflow`), rlpipe tracks into that server and
the pipeline run's experiment (unless tracking.uri names another), tags the pipeline run's MLflow run
and the RL run with each other (`link_pipeline_run`), and its steps leave their Metrics artifacts
empty (rlpipe.components.finish): every metric is logged once, in the RL run, by iteration.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlpipe.metric_keys import EVAL_ACCURACY, REWARD_MEAN
from rlpipe.spec import RunSpec, flatten, spec_to_dict
from rlpipe.store.commit import record_tracking_run
from rlpipe.store.run_root import (
    created_whole,
    filesystem,
    is_local,
    join,
    list_metrics,
    one_flush_at_a_time,
    read_json,
    read_state,
    tracked_uri,
    write_json,
)
from rlpipe.tracking.registration import RUN_TAG, kubeflow_records, register_versions, registered_model_name
from rlpipe.tracking.uri import kfp_mlflow, tracking_uri

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

SPEC_ARTIFACT = "spec.yaml"
# the MLflow 3 UI files an experiment under GenAI unless told otherwise: this tag says model training
# (the UI's own toggle, ?workflowType=machine_learning in its URL, overrides it)
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def ensure_run(spec: RunSpec, run_root: str) -> str:
    """The MLflow run id for this RL run: from state.json, by tag, or newly created (a fork's run
    names its parent: tags mlflow.parentRunId and rlpipe.forked_from_*)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    state = read_state(run_root) or {}
    if state.get("mlflow_run_id"):
        return state["mlflow_run_id"]
    uri = tracking_uri(spec, run_root)
    if uri.startswith("sqlite:///"):
        created_whole(
            Path(uri.removeprefix("sqlite:///")), lambda at: MlflowClient(f"sqlite:///{at}").search_experiments()
        )
    mlflow.set_tracking_uri(uri)
    client = MlflowClient()
    kfp = None if spec.tracking.uri else kfp_mlflow()
    experiment = client.get_experiment(kfp["MLFLOW_EXPERIMENT_ID"]) if kfp else None  # the pipeline run's
    experiment = experiment or client.get_experiment_by_name(spec.tracking.experiment)
    if experiment is None:
        # sqlite keeps artifacts beside the database (MLflow's default is ./mlruns of whichever process asks)
        location = Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts" if uri.startswith("sqlite:") else None
        experiment_id = client.create_experiment(
            spec.tracking.experiment, artifact_location=location.as_uri() if location else None, tags=EXPERIMENT_KIND
        )
    else:
        experiment_id = experiment.experiment_id
    # a kill between create_run and record_tracking_run must not make a second MLflow run
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{state['run_uid']}'")
    if found:
        run_id = found[0].info.run_id
    else:
        tags = {RUN_TAG: state["run_uid"], "rlpipe.run_root": run_root}
        if parent := state.get("forked_from"):
            tags |= {
                "rlpipe.forked_from_run_root": parent["run_root"],
                "rlpipe.forked_at_iteration": str(parent["iteration"]),
            }
            if parent.get("mlflow_run_id") and parent.get("tracking_uri") == uri:  # the UI nests the fork under it
                tags |= {
                    "mlflow.parentRunId": parent["mlflow_run_id"],
                    "rlpipe.forked_from_run_id": parent["mlflow_run_id"],
                }
        run_id = client.create_run(experiment_id, run_name=spec.name, tags=tags).info.run_id
        params = {k: str(v)[:6000] for k, v in flatten(spec_to_dict(spec)).items()}
        items = list(params.items())
        for start in range(0, len(items), 100):
            client.log_batch(run_id, params=[mlflow.entities.Param(k, v) for k, v in items[start : start + 100]])
    record_tracking_run(run_root, run_id)
    return run_id


def flushed_from(spec: RunSpec, run_root: str) -> dict[str, Any]:
    """What a flush logs from, read without MLflow: the commit and stop, the eval records, the settings."""
    state = read_state(run_root) or {}
    fs, path = filesystem(join(run_root, "metrics"))
    names = [name.rsplit("/", 1)[-1] for name in fs.ls(path, detail=False)] if fs.exists(path) else []
    source = {
        "iteration": state.get("iteration"),
        "stopped": state.get("stopped"),
        "evals": sorted(name for name in names if name.startswith("eval_")),
        "tracking": spec_to_dict(spec)["tracking"],
    }
    return json.loads(json.dumps(source))  # as tracked.json reads back (tuples as lists)


def flush(spec: RunSpec, run_root: str, driver_s: float = 0.0) -> dict[str, Any]:
    """The track step (and `rlpipe run`'s live tracking): log what MLflow lacks of the committed run
    (metrics, the spec, eval samples) and register the evaluated versions tracking.register asks for.
    Returns what it did; at once, without MLflow, when the last complete flush logged from the same
    (`flushed_from`), except in a KFP-integrated task, which also tags its pipeline run. What is committed
    while it flushes is flushed before the lock is let go. `driver_s`: a track step under `rlpipe run`
    (LIVE_TRACKING_ENV set) first gives the driver's flush that long to log the last commit."""
    deadline = time.time() + driver_s
    while time.time() < deadline and flushed_from(spec, run_root) != read_json(tracked_uri(run_root)):
        time.sleep(0.05)
    with one_flush_at_a_time(run_root):
        done: dict[str, Any] | None = None
        source = flushed_from(spec, run_root)
        while source != read_json(tracked_uri(run_root)) or (done is None and kfp_mlflow()):
            more = flush_everything(spec, run_root)
            done = more if done is None else {k: done[k] + v if k in SUMMED_RESULTS else v for k, v in more.items()}
            if not more["run_id"]:
                break
            write_json(tracked_uri(run_root), source)
            source = flushed_from(spec, run_root)
        if done is None:
            run_id = (read_state(run_root) or {}).get("mlflow_run_id", "")
            done = {"run_id": run_id, "points": 0, "artifacts": [], "registered": [], "up_to_date": True}
            return done | ({"model_registry": []} if spec.tracking.model_registry else {})
        return done


SUMMED_RESULTS = ("points", "artifacts", "registered", "model_registry")  # flush_everything's, over its rounds
LIVE_TRACKING_ENV = "RLPIPE_LIVE_TRACKING"  # "1" in the steps of `rlpipe run`, whose driver flushes as it goes


def flush_as_it_commits(spec: RunSpec, run_root: str, stop: threading.Event, every_s: float = 0.2) -> None:
    """`rlpipe run`'s live tracking (a thread of the driver, until `stop`): a flush whenever an iteration
    or an eval is committed, so MLflow follows the run iteration by iteration and the track step at each
    pipeline run's end finds it done (it starts a fraction of a second after the last commit: hence the
    short poll, a read of state.json and a listing of metrics/). A failure waits for the next commit;
    the track step, flushing again, fails naming it. Not for a remote run root (its flushes cannot take
    turns) nor under KFP's MLflow integration (each track step links its pipeline run to what it logged):
    there the track steps flush alone (`live_tracking`)."""
    if not live_tracking(run_root):
        return
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines ("Creating ... tables") not on the console
    tried = None
    while not stop.wait(every_s):
        with contextlib.suppress(Exception):
            source = flushed_from(spec, run_root)
            if source != tried and source["iteration"] is not None:
                tried = source
                flush(spec, run_root)


def live_tracking(run_root: str) -> bool:
    """Whether `rlpipe run` flushes as each iteration commits (and its track steps wait for it)."""
    return is_local(run_root) and kfp_mlflow() is None


def flush_everything(spec: RunSpec, run_root: str) -> dict[str, Any]:
    """`flush`'s work: every committed point, artifact and registration MLflow (and a Kubeflow Model
    Registry) lacks."""
    run_id, logged, iterations = flush_metrics(spec, run_root)
    if not run_id:
        return {"run_id": "", "points": 0}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(spec, run_root))
    artifacts = log_artifacts(spec, run_root, run_id, client)
    registered = register_versions(spec, run_root, run_id, client)
    done = {"run_id": run_id, "points": logged, "artifacts": artifacts, "registered": registered}
    if kfp_mlflow():
        done["pipeline_run"] = link_pipeline_run(spec, run_root, run_id, iterations, client)
    if spec.tracking.model_registry:  # last: a registry that fails leaves every MLflow record in place
        from rlpipe.tracking.kubeflow_registry import register

        records = kubeflow_records(spec, run_root, run_id)
        done["model_registry"] = register(spec.tracking.model_registry, registered_model_name(spec), records)
    return done


def link_pipeline_run(
    spec: RunSpec, run_root: str, run_id: str, iterations: list[int], client: MlflowClient
) -> dict[str, str]:
    """Tag the pipeline run's MLflow run (the parent of this task's, which KFP's MLflow integration made)
    and the RL run `run_id` with each other: the parent gets rlpipe.rl_run_id, rlpipe.run_uid,
    rlpipe.run_root and rlpipe.iterations (those this pipeline run committed, "first-last", or "none");
    the RL run gets rlpipe.pipeline_run.<parent run id> (its KFP run id and URL and the iterations) and
    rlpipe.last_pipeline_run. Idempotent: a repeated track step sets the same tags."""
    from mlflow.tracking import MlflowClient

    kfp = kfp_mlflow() or {}
    pipeline_client = MlflowClient(kfp["MLFLOW_TRACKING_URI"])
    task = pipeline_client.get_run(kfp["MLFLOW_RUN_ID"])
    parent_id = task.data.tags.get("mlflow.parentRunId", task.info.run_id)
    parent = pipeline_client.get_run(parent_id).data.tags
    covered = f"{min(iterations)}-{max(iterations)}" if iterations else "none"
    state = read_state(run_root) or {}
    for key, value in {
        "rlpipe.rl_run_id": run_id,
        "rlpipe.run_uid": state.get("run_uid", ""),
        "rlpipe.run_root": run_root,
        "rlpipe.iterations": covered,
        **({"rlpipe.rl_tracking_uri": spec.tracking.uri} if spec.tracking.uri else {}),
    }.items():
        pipeline_client.set_tag(parent_id, key, value)
    link = {
        "mlflow_run_id": parent_id,
        "kfp_run_id": parent.get("kfp.pipeline_run_id", ""),
        "kfp_run_url": parent.get("kfp.pipeline_run_url", ""),
        "iterations": covered,
    }
    client.set_tag(run_id, f"rlpipe.pipeline_run.{parent_id}", json.dumps(link, sort_keys=True))
    client.set_tag(run_id, "rlpipe.last_pipeline_run", parent_id)
    return link


def flush_metrics(spec: RunSpec, run_root: str) -> tuple[str, int, list[int]]:
    """Log committed iteration and eval metrics MLflow lacks; returns (run id, points logged, the
    iterations whose metrics it logged)."""
    import mlflow
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    state = read_state(run_root)
    if state is None:  # initialization failed before state.json: nothing to log yet
        return "", 0, []
    mlflow.set_tracking_uri(tracking_uri(spec, run_root))
    run_id = ensure_run(spec, run_root)
    client = MlflowClient()
    committed = state.get("iteration", -1)
    logged, iterations = 0, []
    for kind, marker in (("iter", REWARD_MEAN), ("eval", EVAL_ACCURACY)):
        have = {m.step for m in client.get_metric_history(run_id, marker)}
        for iteration, values in sorted(list_metrics(run_root, kind).items()):
            if iteration > committed or iteration in have:
                continue
            now = int(time.time() * 1000)
            records = [Metric(key, float(value), now, iteration) for key, value in sorted(values.items())]
            # the marker goes last: its presence means the whole point was logged
            records.sort(key=lambda m: m.key == marker)
            for start in range(0, len(records), 1000):
                client.log_batch(run_id, metrics=records[start : start + 1000])
            logged += 1
            iterations += [iteration] if kind == "iter" else []
    return run_id, logged, iterations


def log_artifacts(spec: RunSpec, run_root: str, run_id: str, client: MlflowClient) -> list[str]:
    """The spec (spec.yaml), and each committed eval's held-out samples as an MLflow table
    (eval_samples/eval_N.json: prompt, completion, answer, reward, correct, strict, and with
    evaluation.samples sampled_correct; a named set's eval_N_<name>.json), unless the run has them."""
    from rlpipe.store.run_root import read_eval_samples

    have = {a.path for a in client.list_artifacts(run_id)}
    if "eval_samples" in have:
        have |= {a.path for a in client.list_artifacts(run_id, "eval_samples")}
    logged = []
    if SPEC_ARTIFACT not in have:
        client.log_dict(run_id, spec_to_dict(spec), SPEC_ARTIFACT)
        logged.append(SPEC_ARTIFACT)
    committed = (read_state(run_root) or {}).get("iteration", -1)
    names = [None] + [held_out.name for held_out in spec.evaluation.sets]
    for iteration, name in itertools.product(sorted(list_metrics(run_root, "eval")), names):
        path = f"eval_samples/eval_{iteration:06d}{'' if name is None else '_' + name}.json"
        if iteration > committed or path in have or not (samples := read_eval_samples(run_root, iteration, name)):
            continue
        columns = ["index", "prompt", "completion", "answer", "reward", "correct", "strict"]
        rows = [[row.get(c) for c in columns] for row in samples]
        if "samples" in samples[0]:  # evaluation.samples: how many of the k sampled were correct
            columns.append("sampled_correct")
            for row, sample in zip(rows, samples, strict=True):
                row.append(f"{sum(s['reward'] >= 1.0 for s in sample['samples'])}/{len(sample['samples'])}")
        log_table(client, run_id, columns, rows, path)
        logged.append(path)
    return logged


def log_table(client: MlflowClient, run_id: str, columns: list[str], rows: list[list[Any]], path: str) -> None:
    """What mlflow.log_table writes (a {columns, data} JSON the UI shows as a table, listed in the
    run's mlflow.loggedArtifacts tag), without pandas: the step image has mlflow-skinny."""
    client.log_dict(run_id, {"columns": columns, "data": rows}, path)
    tag = client.get_run(run_id).data.tags.get("mlflow.loggedArtifacts")
    listed = json.loads(tag) if tag else []
    if {"path": path, "type": "table"} not in listed:
        client.set_tag(run_id, "mlflow.loggedArtifacts", json.dumps([*listed, {"path": path, "type": "table"}]))


def record_harness(spec: RunSpec, run_root: str, version: int, metrics: dict[str, float]) -> list[str]:
    """A harness run on version N outside the loop (rlpipe.evaluation.harness.harness_version): its metrics on the RL
    run at step N, and as tags of each model version registered from vN. Returns those model versions."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    run_id = ensure_run(spec, run_root)
    client = MlflowClient(tracking_uri(spec, run_root))
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(key, value, now, version) for key, value in sorted(metrics.items())])
    name, uid = registered_model_name(spec), (read_state(run_root) or {}).get("run_uid")
    tagged = []
    for model_version in client.search_model_versions(f"name = '{name}'"):
        tags = model_version.tags
        if tags.get(RUN_TAG) == uid and tags.get("rlpipe.weights_version") == str(version):
            for key, value in metrics.items():
                client.set_model_version_tag(name, model_version.version, key, f"{value:.4f}")
            tagged.append(model_version.version)
    return tagged
