"""Sandboxed code execution as a reward: {type: code_sandbox, tests_column: tests, ...}.

Each completion's program (its last ```python block, else the whole text) runs against its row's
tests in a fresh subprocess:
  - tests as text (Python with asserts) run after the program: reward 1.0 when it exits 0;
  - tests as a list of {input, output} (or that list as a JSON string) run the program once per
    case on stdin, comparing stdout (stripped): reward = the fraction of cases passed
    (`partial: false`: 1.0 only when all pass).
Every run gets a throwaway directory, a minimal environment, hard limits on address space
(`memory_mb`), CPU seconds and output size, a wall-clock limit (`timeout_s`) after which its whole
process group is killed, no network (a network namespace where the kernel allows one, and always
the guard's audit hook: rlpipe/rewards/sandbox_guard.py), and no fork, exec or writes outside its
directory. A candidate that breaks a rule or a limit gets 0.0 and the reason is recorded (column
reward/<name>/reason); the step goes on.

On a cluster this is one layer: the score step also runs under gVisor (cluster.sandbox_runtime_class)
with a deny-all-egress NetworkPolicy (manifests/base/sandbox.yaml).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.rewards.registry import RewardError, RewardFunction, Rewards, register_reward_type
from rlpipe.rewards.sandbox_guard import MEMORY_EXIT
from rlpipe.rewards.shaping import OptionKinds, options_of

GUARD = Path(__file__).with_name("sandbox_guard.py")
FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0  # wall clock per run
    cpu_s: int = 5
    memory_mb: int = 512  # address space
    file_mb: int = 8  # largest file (and captured output) it may write
    output_chars: int = 100_000  # stdout read back for comparison


@dataclass(frozen=True)
class Outcome:
    passed: bool
    reason: str  # "passed", or why not
    stdout: str = ""


def program_of(completion: str) -> str:
    """The candidate program: the last fenced code block, or the whole completion."""
    blocks = FENCED.findall(completion)
    return blocks[-1] if blocks else completion


@functools.cache
def network_namespace() -> list[str]:
    """`unshare -rn` when this kernel lets an unprivileged process make a network namespace (then the
    candidate has no network device at all); [] otherwise (the audit hook still refuses sockets)."""
    if shutil.which("unshare") is None:
        return []
    try:
        probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ["unshare", "-rn"] if probe.returncode == 0 else []


def run_candidate(source: str, stdin: str, limits: Limits) -> Outcome:
    """Run `source` once under the limits and the guard; what happened."""
    folder = Path(tempfile.mkdtemp(prefix="rlpipe-sandbox-"))
    try:
        (folder / "candidate.py").write_text(source)
        budget = {"memory_mb": limits.memory_mb, "cpu_s": limits.cpu_s, "file_mb": limits.file_mb}
        command = [*network_namespace(), sys.executable, "-I", "-B", str(GUARD), json.dumps(budget)]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(folder), "TMPDIR": str(folder), "LANG": "C.UTF-8"}
        with open(folder / ".stdout", "wb") as out, open(folder / ".stderr", "wb") as err:
            process = subprocess.Popen(
                command,
                cwd=folder,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: killed whole at the limit
            )
            timed_out = False
            try:
                process.communicate(stdin.encode(), timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        stdout = (folder / ".stdout").read_bytes()[: limits.output_chars].decode(errors="replace")
        stderr = (folder / ".stderr").read_bytes()[-4000:].decode(errors="replace")
        violations = (folder / ".violations").read_text().split("\n") if (folder / ".violations").exists() else []
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    code = process.returncode
    if violations and violations[0]:
        return Outcome(False, f"blocked: {violations[0]}")
    if timed_out:
        return Outcome(False, f"wall time limit ({limits.timeout_s:g} s)")
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return Outcome(False, f"cpu time limit ({limits.cpu_s} s)")
    if code in (MEMORY_EXIT, -signal.SIGSEGV):  # by its exit status: what it prints is the candidate's to choose
        return Outcome(False, f"memory limit ({limits.memory_mb} MB)")
    if code == -signal.SIGXFSZ:
        return Outcome(False, f"file size limit ({limits.file_mb} MB)")
    if code != 0:
        last = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or [f"exit code {code}"]
        return Outcome(False, f"failed: {last[0][:200]}")
    return Outcome(True, "passed", stdout)


def score_program(completion: str, tests: Any, limits: Limits, partial: bool) -> tuple[float, str]:
    """(reward, reason) for one completion against its tests."""
    program = program_of(completion)
    if isinstance(tests, str) and tests.lstrip().startswith("["):
        try:
            tests = json.loads(tests)  # cases stored as a JSON string, as many code datasets do
        except json.JSONDecodeError:
            pass  # Python text that starts with a list
    if isinstance(tests, str):
        outcome = run_candidate(program + "\n\n" + tests + "\n", "", limits)
        return float(outcome.passed), outcome.reason
    if not isinstance(tests, list) or not tests or not all(isinstance(t, dict) and "output" in t for t in tests):
        raise ValueError(f"tests must be Python text or a list of {{input, output}}; got {tests!r}")
    passed, reason = 0, "passed"
    for index, case in enumerate(tests):
        outcome = run_candidate(program, str(case.get("input", "")), limits)
        if outcome.passed and outcome.stdout.strip() == str(case["output"]).strip():
            passed += 1
        elif reason == "passed":
            reason = outcome.reason if not outcome.passed else f"wrong output on case {index}"
            if not outcome.passed and outcome.reason.startswith(("blocked", "wall", "cpu", "memory")):
                break  # a rule or a limit: no point running the other cases
    if partial:
        return passed / len(tests), reason
    return float(passed == len(tests)), reason


def code_sandbox(options: dict[str, Any], key: str) -> RewardFunction:
    allowed: dict[str, OptionKinds] = {
        "tests_column": str,
        "timeout_s": (int, float),
        "cpu_s": int,
        "memory_mb": int,
        "file_mb": int,
        "partial": bool,
        "concurrency": int,
    }
    options_of(options, allowed, (), key, "code_sandbox")
    column = options.get("tests_column", "tests")
    timeout_s = float(options.get("timeout_s", 5))
    limits = Limits(
        timeout_s=timeout_s,
        cpu_s=options.get("cpu_s", max(1, int(timeout_s))),
        memory_mb=options.get("memory_mb", 512),
        file_mb=options.get("file_mb", 8),
    )
    partial, workers = options.get("partial", True), options.get("concurrency", os.cpu_count() or 1)

    def run_tests(prompts: list[str], completions: list[str], **columns: Any) -> Rewards:
        if column not in columns:
            raise RewardError(
                f"{key}: code_sandbox needs the data column {column!r} (tests_column); have {sorted(columns)}"
            )
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(
                pool.map(
                    lambda pair: score_program(pair[0], pair[1], limits, partial), zip(completions, columns[column])
                )
            )
        return Rewards([r for r, _ in results], [why for _, why in results])

    return run_tests


register_reward_type("code_sandbox", code_sandbox)
