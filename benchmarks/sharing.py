"""Two runs on one machine's device, side by side: one after the other (each alone), both at once without sharing,
and both at once taking turns by one lease (sharing.enabled with sharing.lease), same specs and seeds throughout.

    python benchmarks/sharing.py [--iterations 4]
    python benchmarks/sharing.py --smoke    # benchmarks/smoke.yaml's sizes, 2 iterations: minutes (vLLM starts)

Each run is the demo (examples/addition.yaml) with the resident trainer and one vLLM sampler (rollout.engine
sampler); run a is seed 0, run b seed 1. Per configuration: the wall time until both runs end, the peak memory of
both runs' processes together (the sum of their resident set sizes, sampled every 0.25 s), and how often one run
used the device while the other did, judged by the servers' own records (rlpipe.services.samplers.request_log and
the trainer's request log: an update or evaluate of one run against a generate request or an update of the other)
and, with the lease, by the turns both runs recorded (<run>/sharing/turns/). Each run's weights are checked against
its solo run's (the first configuration), byte for byte.

On a CPU the "device" is the host: sharing can only cost here (the handovers, and turns that leave a core idle); the
figure it buys on a GPU, where two runs do not fit at once, is the memory column. Writes
benchmarks/results/sharing.{json,md} (--smoke: under runs/smoke/ unless --results-dir says).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml
from machine import describe_machine  # benchmarks/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SMOKE = yaml.safe_load((REPO / "benchmarks" / "smoke.yaml").read_text())
SMOKE_ROOT = REPO / "runs" / "smoke"
SPEC = REPO / "examples" / "addition.yaml"
SEEDS = {"a": 0, "b": 1}
CONFIGS = {  # name -> (both at once, sharing one lease)
    "one after the other": (False, False),
    "both at once": (True, False),
    "both at once, one lease": (True, True),
}
DEVICE_PATHS = {  # what a server does on the device (its request log's paths)
    "trainer": ("/update", "/evaluate", "/values"),
    "sampler": ("/inference/v1/generate", "/v1/completions", "/v1/chat/completions", "/collective_rpc"),
}


def settings(seed: int, iterations: int, shared: bool, root: Path, smoke: bool) -> dict:
    """The `--set` keys of one run: the demo with the resident trainer and one sampler, and with `shared` the
    lease both runs take turns by."""
    base = (SMOKE if smoke else {}) | {"seed": seed, "loop.iterations": iterations, "loop.iterations_per_run": 2}
    base |= {"trainer.resident": True, "rollout.engine": "sampler", "samplers.replicas": 1}
    if shared:
        base |= {"sharing.enabled": True, "sharing.lease": "bench", "sharing.lease_root": str(root / "lease")}
    return base


def start(run_dir: Path, keys: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "rlpipe.pipelines.cli", "run", str(SPEC), "--run-dir", str(run_dir)]
    for key, value in keys.items():
        command += ["--set", f"{key}={json.dumps(value)}"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def wait_measuring(drivers: list[subprocess.Popen]) -> float:
    """Wait for every driver; returns the peak of the summed RSS (GB) of their process trees."""
    peak = 0.0
    while any(d.poll() is None for d in drivers):
        total = 0
        for driver in drivers:
            try:
                tree = [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for process in tree:
                try:
                    total += process.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        peak = max(peak, total / 1e9)
        time.sleep(0.25)
    failed = [d.args[d.args.index("--run-dir") + 1] for d in drivers if d.returncode]
    if failed:
        raise SystemExit(f"runs failed: {failed} (their logs: <run dir>.log)")
    return peak


def weights_sha256(run_dir: Path) -> str:
    """The seal of the run's last version: the sha256 of its files' bytes (rlpipe.store.weights)."""
    from rlpipe.store.weights import latest_version, read_weight_ref

    return read_weight_ref(str(run_dir), latest_version(str(run_dir)) or 0)["sha256"]


def device_use(run_dir: Path) -> list[tuple[float, float, str]]:
    """(began, ended, who) of every request the run's servers served on the device, from their own logs."""
    used = []
    for who, paths in DEVICE_PATHS.items():
        for log in (run_dir / "logs").glob(f"{who}*-requests.jsonl"):
            for line in log.read_text().splitlines():
                request = json.loads(line)
                if request["path"] in paths:
                    used.append((request["began"], request["ended"], who))
    return used


def turns(run_dir: Path) -> list[tuple[float, float, str]]:
    records = [json.loads(p.read_text()) for p in (run_dir / "sharing" / "turns").glob("*.json")]
    return [(r["began"], r["ended"], r["phase"]) for r in records]


def overlaps(a: list[tuple[float, float, str]], b: list[tuple[float, float, str]]) -> int:
    """How many pairs of intervals, one from each list, overlap."""
    return sum(1 for x in a for y in b if x[0] < y[1] and y[0] < x[1])


def run_config(name: str, root: Path, iterations: int, smoke: bool) -> dict:
    together, shared = CONFIGS[name]
    runs = {run: root / name.replace(",", "").replace(" ", "-") / run for run in SEEDS}
    started = time.monotonic()
    peak = 0.0
    if together:
        peak = wait_measuring([start(runs[r], settings(SEEDS[r], iterations, shared, root, smoke)) for r in SEEDS])
    else:
        for run in SEEDS:
            peak = max(peak, wait_measuring([start(runs[run], settings(SEEDS[run], iterations, shared, root, smoke))]))
    wall = time.monotonic() - started
    used = {run: device_use(path) for run, path in runs.items()}
    row = {"config": name, "wall_s": round(wall, 1), "peak_rss_gb": round(peak, 2)}
    row["device_overlaps"] = overlaps(used["a"], used["b"]) if together else 0
    row["turn_overlaps"] = overlaps(turns(runs["a"]), turns(runs["b"])) if shared else None
    row["turns"] = {run: len(turns(path)) for run, path in runs.items()} if shared else None
    row["weights"] = {run: weights_sha256(path) for run, path in runs.items()}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, help="default 4 (--smoke: 2)")
    parser.add_argument("--runs", type=Path, help="default runs/sharing (--smoke: runs/smoke/sharing)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (benchmarks/smoke.yaml)")
    parser.add_argument("--results-dir", type=Path, help="default benchmarks/results (--smoke: runs/smoke)")
    args = parser.parse_args()
    iterations = args.iterations or (2 if args.smoke else 4)
    root = args.runs or (SMOKE_ROOT / "sharing" if args.smoke else REPO / "runs" / "sharing")
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} holds earlier runs: remove it, or pass --runs an empty directory")
    rows = []
    for name in CONFIGS:
        rows.append(run_config(name, root, iterations, args.smoke))
        print(f"{name}: {rows[-1]['wall_s']} s, peak {rows[-1]['peak_rss_gb']} GB", flush=True)
    solo = rows[0]["weights"]
    for row in rows:
        row["weights_equal_solo"] = row.pop("weights") == solo
    record = {"machine": describe_machine(), "iterations": iterations, "smoke": args.smoke, "runs": rows}
    lines = [
        f"Two demo runs (resident trainer, one vLLM sampler each), {iterations} iterations, on {record['machine']}.",
        "",
        "| | wall s | x alone | peak RSS GB | device overlaps | turn overlaps | weights = solo |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = row["wall_s"] / rows[0]["wall_s"]
        turned = "-" if row["turn_overlaps"] is None else row["turn_overlaps"]
        lines.append(
            f"| {row['config']} | {row['wall_s']} | {ratio:.2f} | {row['peak_rss_gb']} | {row['device_overlaps']} "
            f"| {turned} | {row['weights_equal_solo']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    results_dir = args.results_dir or (SMOKE_ROOT if args.smoke else RESULTS)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "sharing.md").write_text(text)
    (results_dir / "sharing.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
