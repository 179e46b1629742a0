"""Keys older rlpipe versions read, which a spec may still hold: each is refused with what to write
instead (the error `parse_spec` raises lists them), never silently read as something else.

Imports nothing of rlpipe: rlpipe.spec.validation asks `replaced_keys` before it checks the sections.
"""

from __future__ import annotations

import json
from typing import Any

# Keys of the flat `algorithm` section (before each algorithm's options were its own) that it wrote, not null,
# into every spec.json: at these values they said nothing, and an algorithm without them parses them away.
FLAT_ALGORITHM_DEFAULTS = {"max_oversample": 3.0}


def replaced_keys(data: Any) -> list[str]:
    """What to write instead of each replaced key in the spec dict `data` (none: an empty list)."""
    if not isinstance(data, dict):
        return []
    if "task" in data:
        return [old_task_section(data["task"])]
    return old_gpu_keys(data)


def old_task_section(task: Any) -> str:
    """What to write instead of a `task:` section (replaced by `data:`), shown in the error."""
    task = dict(task) if isinstance(task, dict) else {}
    data: dict[str, Any] = {"generator": task.pop("name", "addition")}
    if "digits" in task:
        data["options"] = {"digits": task.pop("digits")}
    data |= task
    lines = "\n    ".join(f"{key}: {json.dumps(value)}" for key, value in data.items())
    return (
        "task: the `task` section is now `data` (which also reads data files, hub datasets and chat prompts); "
        f"write instead:\n  data:\n    {lines}"
    )


def old_gpu_keys(data: dict[str, Any]) -> list[str]:
    """What to write instead of trainer.processes and cluster.<pod>.gpus, both replaced by trainer.gpus
    (one count of the trainer's GPUs per node), shown in the error."""
    trainer: dict[str, Any] = data["trainer"] if isinstance(data.get("trainer"), dict) else {}
    cluster: dict[str, Any] = data["cluster"] if isinstance(data.get("cluster"), dict) else {}
    pods = {name: pod for name, pod in cluster.items() if isinstance(pod, dict) and "gpus" in pod}
    meaning = "the GPUs the trainer trains on per node; with trainer.device cpu, gloo processes"
    problems = []
    if "processes" in trainer:
        problems.append(
            f"trainer.processes: replaced by trainer.gpus ({meaning}); write instead:\n"
            f"    trainer:\n      gpus: {trainer['processes']}"
        )
    if "trainer" in pods:
        count = pods["trainer"]["gpus"]
        instead = "device: cpu" if count in (0, "0") else f"gpus: {count}"
        problems.append(
            f"cluster.trainer.gpus: replaced by trainer.gpus ({meaning}: the update pod requests that many GPUs, "
            f"the other trainer-image steps one); write instead:\n    trainer:\n      {instead}"
        )
    for name in sorted(set(pods) - {"trainer"}):
        problems.append(f"cluster.{name}.gpus: removed (steps on the {name} image compute without torch); delete it")
    return problems
