"""The trainer's one door (rlpipe.training.session): one iteration, traced, enters the weight store's
weights module once per thing a step needs from it, and passes through a bounded part of rlpipe."""

from __future__ import annotations

import ast
import sys
import threading
from collections import Counter
from pathlib import Path

from .conftest import REPO

WEIGHTS_MODULE = str(REPO / "rlpipe" / "store" / "weights.py")
KL_REFERENCE = "load_reference"  # the trainer's frozen v0 for the KL term: another version than the one followed


def traced_iteration(spec, run_root: str, cache: str, work: Path) -> tuple[Counter, set[str]]:
    """One iteration of `rlpipe.loop.run_iteration` from v0 under a profiler: (the entries into
    store/weights.py, as (function, calling file under rlpipe/, whether the trainer asked: a frame of
    rlpipe/training/ below) -> count, and the rlpipe files that ran Python). An entry is a call into the module
    with no frame of the module below it on the stack (its own calls, and those it makes through contextlib,
    are inside one entry)."""
    from rlpipe import loop
    from rlpipe.store.weights import read_weight_ref

    weights = read_weight_ref(run_root, 0)
    rlpipe_root = str(REPO / "rlpipe") + "/"
    entries: Counter = Counter()
    ran: set[str] = set()

    def record(frame, event, arg) -> None:
        if event != "call":
            return
        ran.add(frame.f_code.co_filename)
        if frame.f_code.co_filename != WEIGHTS_MODULE:
            return
        stack, callers, below = [], [], frame.f_back
        while below is not None:
            stack.append(below.f_code.co_filename.removeprefix(rlpipe_root))
            callers.append(below.f_code.co_name)
            below = below.f_back
        if WEIGHTS_MODULE.removeprefix(rlpipe_root) not in stack:
            trainer = any(name.startswith("training/") for name in stack)
            entries[(frame.f_code.co_name, stack[0] if stack else "?", trainer, KL_REFERENCE in callers)] += 1

    work.mkdir(parents=True, exist_ok=True)
    sys.setprofile(record)
    threading.setprofile(record)  # rewards run in a thread of their own (reward.timeout_s)
    try:
        loop.run_iteration(spec, run_root, weights, 1, work, cache)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return entries, {name for name in ran if name.startswith(rlpipe_root)}


def test_one_iteration_enters_the_weight_store_once_per_need(initialized_run, tmp_path: Path):
    """Following the weights reference through one GRPO iteration enters store/weights.py 4 times, once per
    need: generate loads v(N)'s files (models.loading), the update's session opens v(N) and writes v(N+1),
    sync_weights publishes it (and learns its size from the same call). The session also opens the frozen
    reference v0 for the KL term (a fifth entry, for another version). At a6f62e0, before the session: the
    iteration entered 11 times (15 with pruning, then in this module), the trainer 7; one iteration ran 40
    rlpipe files (7,786 lines); at 3cfd3e5, 40 (7,295)."""
    spec, run_root, cache = initialized_run
    entries, files = traced_iteration(spec, run_root, cache, tmp_path / "work")
    # pruning (rlpipe.store.pruning, after the commit) lists the store's folders and never takes the reference
    needs = Counter({key: n for key, n in entries.items() if key[1] != "store/pruning.py"})
    following = Counter({key: n for key, n in needs.items() if not key[3]})
    assert sum(following.values()) <= 4, following
    assert sum(needs.values()) - sum(following.values()) <= 1, needs  # the KL reference, once
    assert sum(n for (_, _, trainer, _), n in needs.items() if trainer) <= 3, needs
    lines = sum(len(Path(name).read_text().splitlines()) for name in files)
    assert len(files) <= 42 and lines <= 7_600, (len(files), lines)  # at 3cfd3e5: 40 files, 7,295 lines


def test_the_resident_server_reaches_training_through_the_session_alone():
    """The server keeps the wire (HTTP, the version key, the ranks' protocol): what it needs of
    rlpipe/training/ it imports from rlpipe.training.session."""
    tree = ast.parse((REPO / "rlpipe" / "services" / "trainer" / "server.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {m for m in imported if m.startswith("rlpipe.training")} == {"rlpipe.training.session"}


def test_the_update_step_and_the_server_train_through_one_session(initialized_run, tmp_path: Path):
    """The per-step update is a TrainerSession opened, updated and dropped; the server's /update the
    same session kept: both give the same v(N+1) from v0."""
    from rlpipe import loop
    from rlpipe.services.trainer.server import Resident, answer
    from rlpipe.spec import spec_to_dict
    from rlpipe.store.weights import read_weight_ref
    from rlpipe.training.session import update_policy

    spec, run_root, cache = initialized_run
    v0 = read_weight_ref(run_root, 0)
    rollouts, scored, batch = (str(tmp_path / f"{name}.parquet") for name in ("rollouts", "scored", "batch"))
    loop.generate(spec, run_root, v0, 1, rollouts, cache)
    loop.score(spec, rollouts, scored)
    loop.advantages(spec, scored, batch)
    per_step, _ = update_policy(spec, run_root, v0, batch, 1, cache)
    resident = Resident()
    request = {"spec": spec_to_dict(spec), "run_root": run_root, "weights": v0, "batch_uri": batch}
    status, body = answer("/update", request | {"iteration": 1, "cache_root": cache}, resident)
    assert status == 200, body
    assert body["staged"]["sha256"] == per_step["sha256"] and resident.session is not None
    assert resident.session.weights == body["staged"] and body["metrics"]["trainer/reloaded"] == 1.0
