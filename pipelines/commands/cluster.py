"""`rlpipe compile`, `submit` and `schedule`: the commands that put the pipeline on a cluster."""

from __future__ import annotations

import argparse

from rlpipe.pipelines.commands.arguments import spec_from_args
from rlpipe.spec import DeviceClaimSpec, RunSpec


def cmd_compile(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    if args.target == "argo":
        from rlpipe.dpo_loop import is_offline_dpo
        from rlpipe.pipelines.argo_export import export_argo

        if is_offline_dpo(spec):
            raise ValueError("algorithm.name dpo compiles to KFP only (its own pipeline); drop --target argo")
        path = export_argo(spec, args.output, run_root=args.run_root)
        print(f"wrote {path}: a WorkflowTemplate and a CronWorkflow; `kubectl apply -n rlpipe -f {path}`")
    else:
        from rlpipe.pipelines.compile import compile_pipeline

        path = compile_pipeline(spec, args.output, run_root=args.run_root)
        print(f"wrote {path}: upload it in the KFP UI or submit it with kfp.Client().create_run_from_pipeline_package")
    if spec.trainer.resident:
        from rlpipe.pipelines.trainer_jobset import trainer_url, write_trainer

        trainer = write_trainer(spec, args.output)
        print(
            f"wrote {trainer}: the resident trainer ({spec.trainer.nodes} node(s) x {spec.trainer.gpus} processes, "
            f"a JobSet) and its Service {spec.trainer.endpoint or trainer_url(spec)}; `kubectl apply -f {trainer}`"
        )
    if spec.sharing.claim is not None:
        _write_shared_device(spec, spec.sharing.claim, args)
    return 0


def _write_shared_device(spec: RunSpec, claim: DeviceClaimSpec, args: argparse.Namespace) -> None:
    """sharing.claim: the ResourceClaim and the samplers on it, beside the pipeline; which tasks lose the device."""
    from rlpipe.pipelines.compile import cluster_spec_and_root
    from rlpipe.pipelines.shared_device import steps_without_the_device, write_shared_device

    _, run_root = cluster_spec_and_root(spec, args.run_root)
    path = write_shared_device(spec, args.output, run_root)
    print(
        f"wrote {path}: ResourceClaim {claim.name} ({claim.count} x {claim.device_class}) and the samplers' Deployment "
        f"({spec.samplers.replicas} replica(s)) on it; `kubectl apply -f {path}` before the trainer"
    )
    if steps := steps_without_the_device(spec):
        print(
            "note: sharing.enabled: no KFP task can use the shared claim, so these steps compute on the CPU: "
            f"{', '.join(steps)} (docs/sharing-accelerators.md)"
        )


def _say_how_to_start_the_trainer(spec: RunSpec, args: argparse.Namespace) -> None:
    """A resident trainer is not part of the pipeline run: it must already serve (rlpipe compile writes it)."""
    if spec.trainer.resident and not spec.trainer.endpoint:
        from rlpipe.pipelines.trainer_jobset import trainer_url

        print(
            f"trainer.resident: the steps call {trainer_url(spec)}; start it first: `rlpipe compile {args.spec} "
            "-o rl.yaml` writes it as rl.trainer.yaml, then `kubectl apply -f rl.trainer.yaml`"
        )
    if spec.sharing.claim is not None:
        print(
            f"sharing.claim: the trainer and the samplers share ResourceClaim {spec.sharing.claim.name}; `rlpipe "
            f"compile {args.spec} -o rl.yaml` writes it with the samplers as rl.shared-device.yaml: apply it first"
        )


def cmd_submit(args: argparse.Namespace) -> int:
    from rlpipe.pipelines.submit import submit_run

    spec = spec_from_args(args)
    _say_how_to_start_the_trainer(spec, args)
    mlflow = None if args.no_mlflow_experiment else spec.tracking.experiment
    run = submit_run(spec, args.host, args.experiment, args.run_root, args.wait, args.token, mlflow)
    print(f"run {run.id}: {run.url}")
    if run.state is not None:
        print(f"finished: {run.state}")
        return 0 if run.state == "SUCCEEDED" else 1
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    from rlpipe.pipelines.submit import schedule_run

    spec = spec_from_args(args)
    _say_how_to_start_the_trainer(spec, args)
    mlflow = None if args.no_mlflow_experiment else spec.tracking.experiment
    recurring = schedule_run(spec, args.host, args.experiment, args.cron, args.every, args.run_root, args.token, mlflow)
    print(f"recurring run {recurring.id}: {recurring.url}")
    print(f"each run continues {spec.name} by up to {spec.loop.iterations_per_run} iterations; no-op when done")
    return 0


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec")
    parser.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kfp.example.com/pipeline")
    parser.add_argument("--experiment", default="rlpipe", help="KFP experiment (created if missing)")
    parser.add_argument("--run-root", help="run root on the cluster (default: on cluster.pvc, or storage.root)")
    parser.add_argument("--token", help="bearer token (default: $KFP_BEARER_TOKEN, else kfp.Client's discovery)")
    parser.add_argument(
        "--no-mlflow-experiment",
        action="store_true",
        help="send no plugins_input.mlflow.experiment_name (KFP API servers before 2.17); by default it names "
        "tracking.experiment, so KFP's MLflow integration files the pipeline run beside the RL run",
    )
    parser.add_argument("--set", action="append", metavar="KEY=VALUE")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """compile, submit and schedule: the commands that put the pipeline on a cluster."""
    comp = sub.add_parser("compile", help="write the pipeline as KFP IR YAML for a cluster")
    comp.add_argument("spec")
    comp.add_argument("-o", "--output", required=True, help="output YAML path")
    comp.add_argument("--run-root", help="run root the cluster steps use (default: on cluster.pvc, or storage.root)")
    comp.add_argument("--target", choices=["kfp", "argo"], default="kfp", help="KFP IR YAML, or Argo Workflows")
    comp.add_argument("--set", action="append", metavar="KEY=VALUE")
    comp.set_defaults(func=cmd_compile)

    submit = sub.add_parser("submit", help="start one KFP run of the pipeline (kfp.Client)")
    _cluster_arguments(submit)
    submit.add_argument("--wait", type=int, metavar="SECONDS", help="wait up to SECONDS for the run to finish")
    submit.set_defaults(func=cmd_submit)

    schedule = sub.add_parser("schedule", help="create a KFP recurring run that keeps the loop going")
    _cluster_arguments(schedule)
    when = schedule.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help="cron expression, 5 fields (or 6 with seconds), e.g. '0 * * * *'")
    when.add_argument("--every", help="interval, e.g. 30m, 2h, 1d")
    schedule.set_defaults(func=cmd_schedule)
