"""The run-root commands: `rlpipe export`, `status`, `harness` and `fork`, each on a run root that a run
wrote (what status and fork do to it: rlpipe/commands/)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from rlpipe.pipelines.commands.arguments import overrides, run_root_of


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
    from rlpipe.spec import parse_spec
    from rlpipe.store.run_root import read_json
    from rlpipe.store.weights import read_weight_ref
    from rlpipe.tracking.kubeflow_registry import WHOLE, model_format, version_name
    from rlpipe.tracking.registration import registered_model_name, registered_versions

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


def cmd_status(args: argparse.Namespace) -> int:
    from rlpipe.commands.status import as_json, describe, run_status

    status = run_status(run_root_of(args.run))
    print(as_json(status) if args.json else describe(status))
    return 0 if status["initialized"] else 1


def cmd_harness(args: argparse.Namespace) -> int:
    from rlpipe.evaluation.harness import harness_version
    from rlpipe.spec import parse_spec, with_overrides
    from rlpipe.store.run_root import read_json, read_state

    run_root = run_root_of(args.run)
    stored = read_json(str(Path(run_root) / "spec.json"))
    if stored is None:
        print(f"rlpipe harness: {run_root} has no spec.json: not a run root", file=sys.stderr)
        return 1
    spec = parse_spec(with_overrides(stored, overrides(args)), f"{run_root}/spec.json with --set")
    version = read_state(run_root)["weights_version"] if args.version is None else args.version
    metrics = harness_version(spec, run_root, version, spec.cache_root)
    for key, value in sorted(metrics.items()):
        print(f"v{version}  {key}  {value:.4f}")
    print(f"recorded in {run_root}/metrics/harness_v{version:06d}.json and MLflow ({spec.tracking.experiment})")
    return 0


def cmd_fork(args: argparse.Namespace) -> int:
    from rlpipe.commands.fork import fork_run
    from rlpipe.spec import spec_to_dict

    parent = run_root_of(args.run)
    child = str(Path(parent).parent / args.name)
    try:
        spec = fork_run(parent, child, args.from_iteration, args.name, overrides(args))
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


def add_commands(sub: argparse._SubParsersAction) -> None:
    """export, status, harness and fork: a run root's commands."""
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
