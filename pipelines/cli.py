"""`rlpipe` command line: run the loop locally, or compile it for a cluster."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from rlpipe.spec import RunSpec, SpecError, json_schema_text, load_spec, with_reference


def _overrides(args: argparse.Namespace) -> dict:
    values = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError(f"--set {item!r}: expected dotted.key=value, e.g. --set trainer.lr=3e-4")
        values[key] = yaml.safe_load(value)
    if getattr(args, "iterations", None) is not None:
        values["loop.iterations"] = args.iterations
    return values


def _spec(args: argparse.Namespace) -> RunSpec:
    spec = load_spec(args.spec, _overrides(args))
    root = spec.storage.root
    if "://" not in root:  # steps may run with another working directory
        spec = dataclasses.replace(spec, storage=dataclasses.replace(spec.storage, root=str(Path(root).resolve())))
    local_files = {  # data files relative to the working directory, like storage.root
        key: str(Path(value).resolve())
        for key in ("path", "eval_path")
        if (value := getattr(spec.data, key)) and "://" not in value and Path(value).exists()
    }
    return dataclasses.replace(spec, data=dataclasses.replace(spec.data, **local_files)) if local_files else spec


def cmd_run(args: argparse.Namespace) -> int:
    return _run_here(_spec(args), args)


def cmd_rehearse(args: argparse.Namespace) -> int:
    from rlpipe.pipelines.rehearse import load_compiled, local_spec

    pipeline, compiled = load_compiled(args.pipeline)
    args.run_dir = str(Path(args.run_dir or Path("runs") / compiled.get("name", "rlpipe")).resolve())
    spec = local_spec(compiled, args.run_dir, _overrides(args), args.pipeline)
    print(f"rlpipe rehearse {args.pipeline}: its spec, with storage, tracking and services on this machine")
    return _run_here(spec, args, pipeline)


def _run_here(spec: RunSpec, args: argparse.Namespace, compiled: Any = None) -> int:
    """`rlpipe run` (or rehearse) to the end: 0 when the loop is done or its gate passed."""
    from rlpipe.evaluation.stopping import stopped
    from rlpipe.pipelines.local_run import RunStopped, run_locally

    try:
        state = run_locally(
            spec, args.run_dir, containers=args.containers, fresh_steps=args.fresh_steps, compiled=compiled
        )
    except RunStopped as err:
        print(f"rlpipe: {err}", file=sys.stderr)
        return 128 + err.signum
    stop = stopped(spec, state)  # the eval gate's (with its `when`) ends the loop as done; a sign's does not
    return 0 if state.get("iteration", 0) >= spec.loop.iterations or (stop is not None and stop.when) else 1


def cmd_check(args: argparse.Namespace) -> int:
    from rlpipe.run.preflight import PreflightError, preflight
    from rlpipe.store.run_root import run_root_for

    spec = _spec(args)
    run_root = str(Path(args.run_dir).resolve()) if args.run_dir else run_root_for(spec.storage.root, spec.name)
    print(f"rlpipe check {args.spec}: run root {run_root}")
    try:
        preflight(spec, run_root, say=print)
    except PreflightError as err:
        print(f"{str(err).count(chr(10) + '  - ')} check(s) failed: fix the keys named above", file=sys.stderr)
        return 1
    print("all checks passed: `rlpipe run` would start")
    return 0


def cmd_estimate_memory(args: argparse.Namespace) -> int:
    from rlpipe.training.memory_estimate import estimate_memory, model_shape

    spec = _spec(args)
    shape = model_shape(spec, spec.cache_root)
    seq_len = args.seq_len or (spec.data.max_prompt_tokens or 512) + spec.rollout.max_new_tokens
    gpus = args.gpus or spec.trainer.gpus * spec.trainer.nodes
    estimate = estimate_memory(spec, shape, seq_len, gpus, args.gpu_memory_gib)
    print(
        f"rlpipe estimate-memory {args.spec}: {shape.parameters / 1e9:.3f}B parameters ({shape.layers} layers, hidden "
        f"{shape.hidden}, vocab {shape.vocab}), sequences of {seq_len} tokens, {gpus} GPU(s), "
        f"trainer.dtype {spec.trainer.dtype}"
    )
    print(estimate.table())
    if not estimate.advice:
        print("fits (estimate within 90% of the GPU)")
        return 0
    print("does not fit; change, in this order:")
    for line in estimate.advice:
        print(f"  - {line}")
    return 1


def cmd_export(args: argparse.Namespace) -> int:
    from rlpipe.models.loading import export_model

    run_root = str(Path(args.run_dir).resolve())
    version, out = export_model(run_root, args.version, args.output, Path(run_root) / ".export-cache")
    print(f"wrote v{version} of {run_root} to {out} (adapters merged): load it with from_pretrained or serve it")
    for line in _model_registry_lines(run_root, version, out):
        print(line)
    return 0


def _model_registry_lines(run_root: str, version: int, out: str) -> list[str]:
    """Where a serving team finds version `version` in the run's Kubeflow Model Registry (tracking.model_registry),
    when the track step registers it there (tracking.register chose it)."""
    from rlpipe.run.kubeflow_registry import WHOLE, model_format, version_name
    from rlpipe.run.tracking import registered_model_name, registered_versions
    from rlpipe.spec import parse_spec
    from rlpipe.store.run_root import read_json
    from rlpipe.store.weights import read_weight_ref

    stored = read_json(str(Path(run_root) / "spec.json"))
    spec = parse_spec(stored, f"{run_root}/spec.json") if stored else None
    if spec is None or spec.tracking.model_registry is None or version not in registered_versions(spec, run_root):
        return []
    registry, name, registered = spec.tracking.model_registry, registered_model_name(spec), version_name(version)
    fmt, _ = model_format(read_weight_ref(run_root, version)["uri"])
    port = f", port={registry.port}" if registry.port else ""
    lines = [
        f"Kubeflow Model Registry {registry.server_address}: model {name!r}, version {registered!r} ({fmt}):",
        f"  ModelRegistryClient({registry.server_address!r}{port}).get_model_artifact({name!r}, {registered!r}).uri",
        "  is the weights' URI (KServe's storageUri); get_model_version(...).custom_properties: run, iteration, evals",
    ]
    if fmt != WHOLE:  # an adapter or a delta is not a servable directory: the exported one is
        lines.append(f"  that URI holds a {fmt} version, not a servable model: serve {out} instead (upload it)")
    return lines


def cmd_compile(args: argparse.Namespace) -> int:
    spec = _spec(args)
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
    return 0


def _say_how_to_start_the_trainer(spec: RunSpec, args: argparse.Namespace) -> None:
    """A resident trainer is not part of the pipeline run: it must already serve (rlpipe compile writes it)."""
    if spec.trainer.resident and not spec.trainer.endpoint:
        from rlpipe.pipelines.trainer_jobset import trainer_url

        print(
            f"trainer.resident: the steps call {trainer_url(spec)}; start it first: `rlpipe compile {args.spec} "
            "-o rl.yaml` writes it as rl.trainer.yaml, then `kubectl apply -f rl.trainer.yaml`"
        )


def cmd_submit(args: argparse.Namespace) -> int:
    from rlpipe.pipelines.submit import submit_run

    spec = _spec(args)
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

    spec = _spec(args)
    _say_how_to_start_the_trainer(spec, args)
    mlflow = None if args.no_mlflow_experiment else spec.tracking.experiment
    recurring = schedule_run(spec, args.host, args.experiment, args.cron, args.every, args.run_root, args.token, mlflow)
    print(f"recurring run {recurring.id}: {recurring.url}")
    print(f"each run continues {spec.name} by up to {spec.loop.iterations_per_run} iterations; no-op when done")
    return 0


def _run_root(run: str) -> str:
    """A run root from a path, or from a run name under ./runs."""
    path = Path(run)
    if not path.exists() and "/" not in run and (Path("runs") / run).exists():
        path = Path("runs") / run
    return str(path.resolve())


def cmd_status(args: argparse.Namespace) -> int:
    from rlpipe.run.status import as_json, describe, run_status

    status = run_status(_run_root(args.run))
    print(as_json(status) if args.json else describe(status))
    return 0 if status["initialized"] else 1


def cmd_harness(args: argparse.Namespace) -> int:
    from rlpipe.evaluation.harness import harness_version
    from rlpipe.spec import parse_spec, with_overrides
    from rlpipe.store.run_root import read_json, read_state

    run_root = _run_root(args.run)
    stored = read_json(str(Path(run_root) / "spec.json"))
    if stored is None:
        print(f"rlpipe harness: {run_root} has no spec.json: not a run root", file=sys.stderr)
        return 1
    spec = parse_spec(with_overrides(stored, _overrides(args)), f"{run_root}/spec.json with --set")
    version = read_state(run_root)["weights_version"] if args.version is None else args.version
    metrics = harness_version(spec, run_root, version, spec.cache_root)
    for key, value in sorted(metrics.items()):
        print(f"v{version}  {key}  {value:.4f}")
    print(f"recorded in {run_root}/metrics/harness_v{version:06d}.json and MLflow ({spec.tracking.experiment})")
    return 0


def cmd_fork(args: argparse.Namespace) -> int:
    from rlpipe.run.fork import fork_run
    from rlpipe.spec import spec_to_dict

    parent = _run_root(args.run)
    child = str(Path(parent).parent / args.name)
    try:
        spec = fork_run(parent, child, args.from_iteration, args.name, _overrides(args))
    except ValueError as err:
        print(f"rlpipe fork: {err}", file=sys.stderr)
        return 1
    spec_file = Path(child) / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec_to_dict(spec), sort_keys=False))
    print(f"rlpipe fork: {child} starts from {parent} at iteration {args.from_iteration}")
    if json.loads((Path(child) / "state.json").read_text())["forked_from"]["optimizer_state"] == "fresh":
        kept = "only the latest version's is kept"
        print(f"  the parent has no optimizer state for v{args.from_iteration} ({kept}): AdamW starts anew")
    print(f"continue it with: rlpipe run {spec_file} --run-dir {child}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    if args.docs:
        page = Path(args.docs)
        page.write_text(with_reference(page.read_text()))
        print(f"rewrote the generated key reference in {page}")
    elif args.out:
        Path(args.out).write_text(json_schema_text())
        print(f"wrote the run spec's JSON Schema to {args.out}")
    else:
        print(json_schema_text(), end="")
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


def _cluster_commands(sub: argparse._SubParsersAction) -> None:
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


def _run_here_options(parser: argparse.ArgumentParser, run_dir: str, override: str) -> None:
    """The options of a loop run on this machine (`rlpipe run`, `rlpipe rehearse`)."""
    parser.add_argument("--run-dir", help=run_dir)
    parser.add_argument("--iterations", type=int, help="total iterations (overrides loop.iterations)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help=override)
    parser.add_argument(
        "--containers",
        action="store_true",
        help="every step and service in the image the cluster runs it in (KFP's DockerRunner over Docker or Podman; "
        "build the images with images/build.sh)",
    )
    parser.add_argument(
        "--fresh-steps",
        action="store_true",
        help="each step a fresh process (or container) as KFP's runners start it, not a fork of a warm one "
        "(one a step image): slower by its interpreter's start and imports (and the container's)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpipe", description="RL post-training for LLMs as Kubeflow Pipelines")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the loop on KFP's local runner (resumes from state.json)")
    run.add_argument("spec", help="run spec YAML, e.g. examples/addition.yaml")
    _run_here_options(run, "run root (default <storage.root>/<name>)", "override a spec value, e.g. trainer.lr=3e-4")
    run.set_defaults(func=cmd_run)

    rehearse = sub.add_parser(
        "rehearse", help="run a pipeline file `rlpipe compile` wrote on this machine, as it is (before a cluster does)"
    )
    rehearse.add_argument("pipeline", help="the compiled pipeline YAML, e.g. addition-gke.yaml")
    _run_here_options(rehearse, "run root on this machine (default runs/<name>)", "override a value of the file's spec")
    rehearse.set_defaults(func=cmd_rehearse)

    check = sub.add_parser("check", help="pre-flight: check the spec, model, data, rewards, tracking and storage")
    check.add_argument("spec")
    check.add_argument("--run-dir", help="run root (default <storage.root>/<name>)")
    check.add_argument("--set", action="append", metavar="KEY=VALUE")
    check.set_defaults(func=cmd_check)

    memory = sub.add_parser(
        "estimate-memory", help="estimate per-GPU training memory for the spec and say what to change"
    )
    memory.add_argument("spec")
    memory.add_argument(
        "--gpus", type=int, help="GPUs the trainer shards over (FSDP; default: trainer.gpus x trainer.nodes)"
    )
    memory.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (H100: 80)")
    memory.add_argument(
        "--seq-len",
        type=int,
        help="prompt + completion tokens (default: data.max_prompt_tokens or 512, plus rollout.max_new_tokens)",
    )
    memory.add_argument("--set", action="append", metavar="KEY=VALUE")
    memory.set_defaults(func=cmd_estimate_memory)

    export = sub.add_parser("export", help="write a weights version as a plain HF model directory (LoRA merged)")
    export.add_argument("run_dir", help="the run's root, e.g. runs/addition-demo")
    export.add_argument("--version", type=int, help="weights version (default: the latest)")
    export.add_argument("-o", "--output", required=True, help="output directory")
    export.set_defaults(func=cmd_export)

    status = sub.add_parser("status", help="where a run stands: iteration, versions, evals, what runs")
    status.add_argument("run", help="the run's root (or its name under ./runs)")
    status.add_argument("--json", action="store_true", help="as JSON")
    status.set_defaults(func=cmd_status)

    harness = sub.add_parser("harness", help="run evaluation.harness (lm-evaluation-harness) on a version of a run")
    harness.add_argument("run", help="the run's root (or its name under ./runs)")
    harness.add_argument("--version", type=int, help="the weights version (default: the latest committed)")
    harness.add_argument("--set", action="append", metavar="KEY=VALUE", help="e.g. evaluation.harness.limit=50")
    harness.set_defaults(func=cmd_harness)

    fork = sub.add_parser("fork", help="start a new run from version N of another, to try other settings")
    fork.add_argument("run", help="the parent's run root (or its name under ./runs)")
    fork.add_argument("--from-iteration", type=int, required=True, help="the parent's committed iteration N")
    fork.add_argument("--name", required=True, help="the new run's name (its root: beside the parent's)")
    fork.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="what the fork changes, e.g. algorithm.kl_coef=0.05"
    )
    fork.set_defaults(func=cmd_fork)

    schema = sub.add_parser("schema", help="print the run spec's JSON Schema, or write the docs' key reference")
    schema.add_argument("-o", "--out", help="write the schema to this file, e.g. docs/rlpipe-spec.schema.json")
    schema.add_argument(
        "--docs", nargs="?", const="docs/configuration.md", metavar="PAGE", help="rewrite PAGE's generated reference"
    )
    schema.set_defaults(func=cmd_schema)

    _cluster_commands(sub)
    return parser


def import_from_working_directory() -> None:
    """Make modules beside the spec importable, as `python -m` does: a reward or data generator
    named 'my_rewards:score' is found in the directory rlpipe runs from, by this process and by
    every step process it starts (kfp.local subprocesses, the resident trainer) through PYTHONPATH."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *filter(None, paths)])


RENAMED = {"plan": "estimate-memory"}  # one meaning per name: `plan` is the loop's first step


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in RENAMED:
        print(f"rlpipe: `rlpipe {argv[0]}` is now `rlpipe {RENAMED[argv[0]]}`", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    import_from_working_directory()
    try:
        return args.func(args)
    except SpecError as err:
        print(f"rlpipe: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"rlpipe: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "rlpipe: interrupted; run the same command again to resume from the last committed iteration",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
