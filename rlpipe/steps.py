"""The step table: the one place that lists rlpipe's steps.

The KFP DAG (pipelines/rl_pipeline.py), the Argo DAG and its entrypoints (pipelines/argo_*),
cluster placement (which image, whether the run root is mounted), the spec's step names
(cluster.secrets[].steps) and the benchmarks all derive from STEPS. Each step's logic is the
plain function named in `function` (rlpipe/loop.py for the iteration's steps).

Whether a step computes in its own process or asks a long-lived service is decided here, in
`service_for`: generate asks the resident trainer (torch engine), is itself the client of the
samplers (sampler engine), or takes the rollout producer's buffer (asynchronous runs); values, update
and evaluate ask the resident trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rlpipe.spec import RunSpec


@dataclass(frozen=True)
class Step:
    name: str  # KFP task, Argo template (with - for _), spec name
    does: str
    phase: Literal["init", "iteration", "fused", "exit", "dpo"]
    function: str  # module:function, the step's plain logic
    torch: bool  # computes with torch: the trainer image and GPU on a cluster, unless a thin client
    run_root: bool  # reads or writes the run root (mounts the shared volume); False: KFP artifacts only
    computes_with: tuple[str, ...] = ()  # modules its process imports when it computes the step itself
    inputs: tuple[str, ...] = ()  # KFP artifacts it reads
    outputs: tuple[str, ...] = ()  # KFP artifacts it writes for the steps after it
    reports: tuple[str, ...] = ()  # Markdown artifacts the KFP UI renders (rlpipe.reports); no step reads them
    stands_for: str | None = None  # the artifact its output replaces for the steps after it
    merges: tuple[str, ...] = ()  # steps whose metrics it merges, in this order (later keys win)
    needs: str | None = None  # runs only for an algorithm that needs this (rlpipe.algorithms: "critic")
    merged_as: str | None = None  # the step whose metrics sync_weights merges as this one's (dpo_update: update)


STEPS: tuple[Step, ...] = (
    Step("prepare", "write the task's train rows and fixed held-out rows", "init", "rlpipe.loop:prepare",
         torch=False, run_root=True, computes_with=("rlpipe.data",)),
    Step("warm_start", "SFT the initial policy to model.warm_start.target_accuracy (cached); stage v0", "init",
         "rlpipe.loop:warm_start", torch=True, run_root=True, computes_with=("rlpipe.training.warm_start",)),
    Step("publish_warm_start", "publish v0 and commit iteration 0", "init", "rlpipe.loop:sync_weights",
         torch=False, run_root=True, computes_with=("rlpipe.store.commit",)),
    Step("plan", "read state.json: the weights and iteration this pipeline run starts from", "init",
         "rlpipe.loop:plan", torch=False, run_root=True),
    Step("iterations_todo", "how many iterations this pipeline run does", "init", "rlpipe.loop:plan",
         torch=False, run_root=True),
    Step("generate", "sample G completions per prompt with v(N)", "iteration", "rlpipe.loop:generate",
         torch=True, run_root=True, computes_with=("rlpipe.engines",), outputs=("rollouts",)),
    Step("score", "reward every completion", "iteration", "rlpipe.loop:score",
         torch=False, run_root=False, computes_with=("rlpipe.rewards",), inputs=("rollouts",), outputs=("scored",)),
    Step("values", "the critic's value of every completion token under critic v(N) (PPO)", "iteration",
         "rlpipe.loop:values", torch=True, run_root=True, computes_with=("rlpipe.training.critic",),
         inputs=("scored",), outputs=("valued",), stands_for="scored", needs="critic"),
    Step("advantages", "the algorithm's advantage per completion", "iteration", "rlpipe.loop:advantages",
         torch=False, run_root=False, computes_with=("rlpipe.algorithms",), inputs=("scored",), outputs=("batch",),
         reports=("rollout_samples",)),
    Step("update", "train v(N) on the batch; stage v(N+1)", "iteration", "rlpipe.loop:update",
         torch=True, run_root=True, computes_with=("rlpipe.training.session",), inputs=("batch",)),
    Step("sync_weights", "publish v(N+1), record the iteration's metrics, commit state.json", "iteration",
         "rlpipe.loop:sync_weights", torch=False, run_root=True, computes_with=("rlpipe.store.commit",),
         reports=("time_breakdown",), merges=("generate", "score", "values", "advantages", "update")),
    Step("evaluate", "greedy held-out accuracy of v(N+1), when due", "iteration", "rlpipe.loop:evaluate",
         torch=True, run_root=True, computes_with=("rlpipe.evaluation.accuracy",), reports=("eval_samples",)),
    Step("iteration", "an iteration's steps and its due eval in one task (loop.fuse_steps)", "fused",
         "rlpipe.loop:run_iteration", torch=True, run_root=True, outputs=("rollouts", "scored", "batch"),
         reports=("rollout_samples", "time_breakdown", "eval_samples")),
    Step("track", "copy committed metrics, eval samples and registered versions to MLflow (exit handler)", "exit",
         "rlpipe.tracking.mlflow_runs:flush", torch=False, run_root=True,
         computes_with=("rlpipe.tracking.mlflow_runs",)),
    # offline DPO's own pipeline (pipelines/dpo_pipeline.py): init, these, then sync_weights and evaluate
    Step("preferences", "build the preference pairs once: v0's samples ranked by the verifier, or the data's",
         "dpo", "rlpipe.dpo_loop:build_preferences", torch=True, run_root=True,
         computes_with=("rlpipe.training.dpo",)),
    Step("reference_logprobs", "the frozen v0's log-probs of every chosen and rejected completion, once", "dpo",
         "rlpipe.dpo_loop:compute_reference_logprobs", torch=True, run_root=True,
         computes_with=("rlpipe.training.dpo",)),
    Step("dpo_update", "DPO on v(N) with the iteration's pairs; stage v(N+1)", "dpo",
         "rlpipe.dpo_loop:dpo_update", torch=True, run_root=True, computes_with=("rlpipe.training.dpo",),
         merged_as="update"),
)  # fmt: skip

BY_NAME = {step.name: step for step in STEPS}
STEP_NAMES = tuple(BY_NAME)
ITERATION_STEPS = tuple(step.name for step in STEPS if step.phase == "iteration")
# evaluate runs after sync_weights only when an eval is due; the rest run every iteration, in order
EVERY_ITERATION = tuple(name for name in ITERATION_STEPS if name != "evaluate")
FUSED = next(step.name for step in STEPS if step.phase == "fused")  # all of an iteration in one task


def check_secret_steps(spec: RunSpec) -> None:
    """ValueError when cluster.secrets gives a secret to a step that is not one (pre-flight and `rlpipe compile`
    ask, before any step runs)."""
    for secret in spec.cluster.secrets:
        unknown = sorted(set(secret.steps or []) - set(STEP_NAMES))
        if unknown:
            raise ValueError(f"cluster.secrets steps {unknown} are not steps; allowed: {', '.join(STEP_NAMES)}")


def iteration_steps(spec: RunSpec) -> tuple[str, ...]:
    """The steps every iteration of this spec runs, in order: EVERY_ITERATION without the steps for
    what its algorithm does not need (the values step runs only with a critic)."""
    from rlpipe.algorithms import get_algorithm

    needs = get_algorithm(spec.algorithm.name).needs
    return tuple(name for name in EVERY_ITERATION if BY_NAME[name].needs in (None, *needs))


def merged_steps(spec: RunSpec) -> tuple[str, ...]:
    """The steps of this spec's iteration whose metrics sync_weights merges, in merge order."""
    steps = iteration_steps(spec)
    return tuple(name for name in BY_NAME["sync_weights"].merges if name in steps)


def service_for(step: str, spec: RunSpec) -> Literal["trainer", "sampler", "producer"] | None:
    """The long-lived service that computes `step` for this spec, or None: it computes in its own
    process. A step with a service is a thin client: no torch, the light image, no GPU. Asynchronous
    runs (loop.max_staleness >= 1) take their rollouts from the producer's buffer (rlpipe.services.producer.buffer), or,
    in the DAG-offset form (loop.overlap dag), sample them in their own process."""
    if step == "generate" and spec.loop.max_staleness >= 1:
        # the DAG-offset form samples with an older version than the resident trainer holds: in its own process
        return "producer" if spec.loop.overlap == "producer" else None
    if step == "generate" and spec.rollout.engine == "sampler":
        return "sampler"
    if step in ("generate", "values", "update", "evaluate") and spec.trainer.resident:
        return "trainer" if step != "generate" or spec.rollout.engine == "torch" else None
    return None


def task_steps(step: str, spec: RunSpec) -> tuple[str, ...]:
    """The steps the task of `step` computes: the fused iteration's (loop.fuse_steps) are the spec's iteration
    steps and evaluate; any other task computes its own step."""
    return (*iteration_steps(spec), "evaluate") if step == FUSED else (step,)


def modules_for(step: str, spec: RunSpec) -> tuple[str, ...]:
    """What the step's process imports to compute it: its own modules, or its service's client."""
    if step == FUSED:
        return tuple(dict.fromkeys(m for s in task_steps(step, spec) for m in modules_for(s, spec)))
    if service_for(step, spec) == "trainer":
        return ("rlpipe.services.trainer.client",)
    if service_for(step, spec) == "producer":
        return ("rlpipe.services.producer.buffer",)
    return BY_NAME[step].computes_with


def iteration_modules(spec: RunSpec) -> tuple[str, ...]:
    """What the tasks of this spec's iterations import (evaluate's included): a warm process that forks
    each task imports them once (rlpipe.pipelines.local_runner.step_forks)."""
    tasks = (FUSED,) if spec.loop.fuse_steps else (*iteration_steps(spec), "evaluate")
    return tuple(dict.fromkeys(module for task in tasks for module in modules_for(task, spec)))


def reward_types(spec: RunSpec) -> set[str]:
    """The `type`s of the spec's reward.functions entries ('function' for 'module:function')."""
    return {f.get("type", "") if isinstance(f, dict) else "function" for f in spec.reward.functions}


def uses_trainer_image(step: str, spec: RunSpec) -> bool:
    """Torch steps run on the trainer image (and GPU), unless a service computes them; so does
    score when a reward model scores; the fused iteration when one of its steps does."""
    if step == FUSED:
        return any(uses_trainer_image(s, spec) for s in task_steps(step, spec))
    if step == "score":
        return "reward_model" in reward_types(spec)
    return BY_NAME[step].torch and service_for(step, spec) is None


def gpus_for(step: str, spec: RunSpec) -> int:
    """GPUs the step's pod requests on a cluster: trainer.gpus for an update that trains in its own pod
    (torchrun, one process per GPU); 1 for the other trainer-image steps (they compute on one device);
    none for the step image, nor with trainer.device cpu (gloo processes)."""
    if spec.trainer.device == "cpu" or not uses_trainer_image(step, spec):
        return 0
    if step == FUSED:
        return max(gpus_for(s, spec) for s in task_steps(step, spec))
    return spec.trainer.gpus if step == "update" else 1


def sandboxed(step: str, spec: RunSpec) -> bool:
    """The step runs model-written code: the score step with a code_sandbox reward, the generate step with
    an environment whose tools include `python`, or the fused iteration that runs one of them. On a cluster its pod
    runs under cluster.sandbox_runtime_class (gVisor) and the sandbox NetworkPolicy (no egress)."""
    if step == FUSED:
        return any(sandboxed(s, spec) for s in task_steps(step, spec))
    if step == "generate":
        environment = spec.rollout.environment
        return (
            environment is not None and environment.type == "tools" and "python" in environment.options.get("tools", [])
        )
    return step == "score" and "code_sandbox" in reward_types(spec)
