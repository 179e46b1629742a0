"""What the commands' arguments become: a spec with its --set overrides, a run root from a name."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import yaml

from rlpipe.spec import RunSpec, SpecError, load_spec


def overrides(args: argparse.Namespace) -> dict:
    """The --set KEY=VALUE pairs (and --iterations) as the spec's overrides."""
    values = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError(f"--set {item!r}: expected dotted.key=value, e.g. --set trainer.lr=3e-4")
        values[key] = yaml.safe_load(value)
    if getattr(args, "iterations", None) is not None:
        values["loop.iterations"] = args.iterations
    return values


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """The spec file with its overrides, its local paths made absolute."""
    spec = load_spec(args.spec, overrides(args))
    root = spec.storage.root
    if "://" not in root:  # steps may run with another working directory
        spec = dataclasses.replace(spec, storage=dataclasses.replace(spec.storage, root=str(Path(root).resolve())))
    local_files = {  # data files relative to the working directory, like storage.root
        key: str(Path(value).resolve())
        for key in ("path", "eval_path")
        if (value := getattr(spec.data, key)) and "://" not in value and Path(value).exists()
    }
    return dataclasses.replace(spec, data=dataclasses.replace(spec.data, **local_files)) if local_files else spec


def run_root_of(run: str) -> str:
    """A run root from a path, or from a run name under ./runs."""
    path = Path(run)
    if not path.exists() and "/" not in run and (Path("runs") / run).exists():
        path = Path("runs") / run
    return str(path.resolve())
