"""`rlpipe` command line: run the loop locally, or compile it for a cluster."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from rlpipe.spec import RunSpec, SpecError, load_spec


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
        spec = spec.model_copy(update={"storage": spec.storage.model_copy(update={"root": str(Path(root).resolve())})})
    return spec


def cmd_run(args: argparse.Namespace) -> int:
    from rlpipe.pipelines.local_run import run_locally

    spec = _spec(args)
    state = run_locally(spec, args.run_dir)
    return 0 if state.get("iteration", 0) >= spec.loop.iterations else 1


def cmd_compile(args: argparse.Namespace) -> int:
    from rlpipe.pipelines.compile import compile_pipeline

    spec = _spec(args)
    path = compile_pipeline(spec, args.output, run_root=args.run_root)
    print(f"wrote {path}: upload it in the KFP UI or submit it with kfp.Client().create_run_from_pipeline_package")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpipe", description="RL post-training for LLMs as Kubeflow Pipelines")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the loop on KFP's local runner (resumes from state.json)")
    run.add_argument("spec", help="run spec YAML, e.g. examples/addition.yaml")
    run.add_argument("--run-dir", help="run root (default <storage.root>/<name>)")
    run.add_argument("--iterations", type=int, help="total iterations (overrides loop.iterations)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec value, e.g. trainer.lr=3e-4")
    run.set_defaults(func=cmd_run)

    comp = sub.add_parser("compile", help="write the pipeline as KFP IR YAML for a cluster")
    comp.add_argument("spec")
    comp.add_argument("-o", "--output", required=True, help="output YAML path")
    comp.add_argument("--run-root", help="run root the cluster steps use (default <storage.root>/<name>)")
    comp.add_argument("--set", action="append", metavar="KEY=VALUE")
    comp.set_defaults(func=cmd_compile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
