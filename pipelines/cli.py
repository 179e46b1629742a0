"""`rlpipe` command line: run the loop locally, or compile it for a cluster. The commands, by what they
act on (pipelines/commands/):

    local_runs   run, rehearse: the loop on this machine, on KFP's local runner
    checks       check, estimate-memory: a spec before it runs
    run_roots    export, status, harness, fork: a run root a run wrote
    cluster      compile, submit, schedule: the pipeline on a cluster
    (here)       schema: the run spec's JSON Schema and the docs' key reference
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlpipe.pipelines.commands import checks, cluster, local_runs, run_roots
from rlpipe.spec import SpecError, json_schema_text, with_reference


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpipe", description="RL post-training for LLMs as Kubeflow Pipelines")
    sub = parser.add_subparsers(dest="command", required=True)
    local_runs.add_commands(sub)
    checks.add_commands(sub)
    run_roots.add_commands(sub)

    schema = sub.add_parser("schema", help="print the run spec's JSON Schema, or write the docs' key reference")
    schema.add_argument("-o", "--out", help="write the schema to this file, e.g. docs/rlpipe-spec.schema.json")
    schema.add_argument(
        "--docs", nargs="?", const="docs/configuration.md", metavar="PAGE", help="rewrite PAGE's generated reference"
    )
    schema.set_defaults(func=cmd_schema)

    cluster.add_commands(sub)
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
