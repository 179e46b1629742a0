"""`rlpipe run` and `rlpipe rehearse`: the loop on this machine, on KFP's local runner
(pipelines/local_runner/), to the end."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rlpipe.pipelines.commands.arguments import overrides, spec_from_args
from rlpipe.spec import RunSpec


def cmd_run(args: argparse.Namespace) -> int:
    return _run_here(spec_from_args(args), args)


def cmd_rehearse(args: argparse.Namespace) -> int:
    from rlpipe.pipelines.local_runner.rehearse import load_compiled, local_spec

    pipeline, compiled = load_compiled(args.pipeline)
    args.run_dir = str(Path(args.run_dir or Path("runs") / compiled.get("name", "rlpipe")).resolve())
    spec = local_spec(compiled, args.run_dir, overrides(args), args.pipeline)
    print(f"rlpipe rehearse {args.pipeline}: its spec, with storage, tracking and services on this machine")
    return _run_here(spec, args, pipeline)


def _run_here(spec: RunSpec, args: argparse.Namespace, compiled: Any = None) -> int:
    """`rlpipe run` (or rehearse) to the end: 0 when the loop is done or its gate passed."""
    from rlpipe.evaluation.stopping import stopped
    from rlpipe.pipelines.local_runner.driver import RunStopped, run_locally

    try:
        state = run_locally(
            spec, args.run_dir, containers=args.containers, fresh_steps=args.fresh_steps, compiled=compiled
        )
    except RunStopped as err:
        print(f"rlpipe: {err}", file=sys.stderr)
        return 128 + err.signum
    stop = stopped(spec, state)  # the eval gate's (with its `when`) ends the loop as done; a sign's does not
    return 0 if state.get("iteration", 0) >= spec.loop.iterations or (stop is not None and stop.when) else 1


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


def add_commands(sub: argparse._SubParsersAction) -> None:
    """run and rehearse: the loop on this machine."""
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
