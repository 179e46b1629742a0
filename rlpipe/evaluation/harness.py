"""An evaluation harness on a weights version: EleutherAI's lm-evaluation-harness (`lm_eval`, the
`harness` extra), as teams on Kubeflow gate promotion on it. evaluation.harness names the tasks: from
lm_eval's registry (they download their datasets) or defined in YAML files under
evaluation.harness.include_path (a task on local files runs offline). The scores are metrics
harness/<task>/<metric> of the eval they run with (the last, or every evaluation.harness.every
iterations): in MLflow, the registered versions' tags and loop.stop_when like any eval metric.
`rlpipe harness RUN --version N` runs it on one version, a registered one too, outside the loop.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlpipe.spec import HarnessSpec, RunSpec


NOT_SCORES = ("sample_len", "alias", "samples")  # what lm_eval's results hold beside the metrics


def harness_due(spec: RunSpec, iteration: int) -> bool:
    """evaluation.harness runs with iteration N's eval: at the last iteration, and where `every` divides N."""
    harness = spec.evaluation.harness
    if harness is None:
        return False
    return iteration == spec.loop.iterations or (harness.every is not None and iteration % harness.every == 0)


def harness_metrics(results: dict[str, Any]) -> dict[str, float]:
    """lm_eval's results ({task: {"exact_match,none": 0.5, "exact_match_stderr,none": ...}}) as metrics
    harness/<task>/<metric> (the filter appended when it is not "none"); stderr and non-numbers left out."""
    metrics = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, chosen = key.partition(",")
            if metric.endswith("_stderr") or metric in NOT_SCORES or not isinstance(value, (int, float)):
                continue
            if isinstance(value, bool) or not math.isfinite(value):
                continue
            name = metric if chosen in ("", "none") else f"{metric}_{chosen}"
            metrics[f"harness/{task}/{name}".replace(" ", "_")] = float(value)
    return metrics


def task_manager(manager_class: Any, include_path: str | None, tasks: list[str]) -> Any:
    """lm_eval's TaskManager over include_path alone when it defines every task (indexing lm_eval's own
    thousands of task files takes most of a small run), else over both."""
    if include_path:
        local = manager_class(include_path=include_path, include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
        return manager_class(include_path=include_path)
    return manager_class()


def unknown_tasks(harness: HarnessSpec, known: list[str]) -> str | None:
    """What to change when evaluation.harness.tasks names a task lm_eval's TaskManager does not know
    (`known`: its all_tasks), or None."""
    import difflib

    missing = [task for task in harness.tasks if task not in known]
    if not missing:
        return None
    path = harness.include_path
    where = f" or in include_path {path} (its YAML files' `task:` names)" if path else ""
    close = sorted({match for task in missing for match in difflib.get_close_matches(task, known, 3)})
    hint = f"; close: {', '.join(close)}" if close else ""
    return (
        f"evaluation.harness.tasks {missing}: no such lm_eval task in its registry{where}{hint}; "
        "`lm-eval ls tasks` lists them; evaluation.harness.include_path adds your own"
    )


def run_harness(spec: RunSpec, model: Any, tokenizer: Any) -> dict[str, float]:
    """evaluation.harness's tasks on `model` (in memory: no copy is written) with lm_eval's HFLM."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise RuntimeError(
            "evaluation.harness runs EleutherAI's lm-evaluation-harness, which is not installed: "
            "pip install 'rlpipe[harness]' (the trainer image has it), or remove evaluation.harness"
        ) from None

    harness = spec.evaluation.harness
    assert harness is not None  # run only when evaluation.harness is set (harness_due, harness_version)
    was_training = model.training
    model.eval()
    try:
        lm = HFLM(
            pretrained=model, tokenizer=tokenizer, batch_size=harness.batch_size, max_gen_toks=harness.max_gen_toks
        )
        manager = task_manager(TaskManager, harness.include_path, harness.tasks)
        if problem := unknown_tasks(harness, manager.all_tasks):
            raise ValueError(problem)
        output = simple_evaluate(
            model=lm,
            tasks=list(harness.tasks),
            task_manager=manager,
            num_fewshot=harness.num_fewshot,
            limit=harness.limit,
            gen_kwargs={"max_gen_toks": harness.max_gen_toks},  # over each task's own (lm_eval's default 256)
            bootstrap_iters=0,
            log_samples=False,
            random_seed=spec.seed,
            numpy_random_seed=spec.seed,
            torch_random_seed=spec.seed,
            fewshot_random_seed=spec.seed,
        )
    finally:
        model.train(was_training)
    return harness_metrics(output["results"])


def harness_version(spec: RunSpec, run_root: str, version: int, cache_root: str) -> dict[str, float]:
    """evaluation.harness's tasks on the run's weights version N (registered or not), outside the loop:
    recorded in metrics/harness_vN.json, logged to the RL run's MLflow run at step N and set as tags of
    the model versions registered from vN (rlpipe.tracking.mlflow_runs.record_harness)."""
    from rlpipe.models.loading import load_weights
    from rlpipe.store.run_root import join, write_json
    from rlpipe.store.weights import read_weight_ref
    from rlpipe.tracking.mlflow_runs import record_harness

    if spec.evaluation.harness is None:
        raise ValueError("evaluation.harness names no tasks: --set 'evaluation.harness={tasks: [...]}'")
    model, tokenizer = load_weights(
        read_weight_ref(run_root, version), cache_root, spec.trainer.threads, spec.trainer.device
    )
    metrics = run_harness(spec, model, tokenizer)
    write_json(join(run_root, "metrics", f"harness_v{version:06d}.json"), metrics)
    record_harness(spec, run_root, version, metrics)
    return metrics
