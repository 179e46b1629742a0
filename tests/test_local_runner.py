"""`rlpipe run` on KFP's local runner: the whole loop, then a kill -9 mid-iteration and a resume."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from rlpipe.store.run_root import list_metrics, read_eval_samples

from .conftest import RLPIPE, tiny_spec_dict


def _write_spec(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tiny_spec_dict(tmp_path, **sections)))
    return path


def _rlpipe(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*RLPIPE, *args], capture_output=True, text=True, **kwargs)


def _mlflow_steps(run_root: Path, key: str, store: Path | None = None) -> list[int]:
    state = json.loads((run_root / "state.json").read_text())
    client = MlflowClient(f"sqlite:///{(store or run_root) / 'mlflow.db'}")
    return sorted(m.step for m in client.get_metric_history(state["mlflow_run_id"], key))


def _check_consistent(run_root: Path, iterations: int, store: Path | None = None) -> None:
    """No iteration lost or duplicated, versions monotone, one MLflow point per iteration (in the
    sqlite store under `store`, by default the run root's)."""
    state = json.loads((run_root / "state.json").read_text())
    assert state["iteration"] == iterations and state["weights_version"] == iterations
    assert (run_root / "weights" / "LATEST").read_text() == f"v{iterations:06d}"
    metrics = sorted(p.name for p in (run_root / "metrics").glob("iter_*.json"))
    assert metrics == [f"iter_{i:06d}.json" for i in range(iterations + 1)]
    manifests = [json.loads(p.read_text()) for p in sorted((run_root / "weights").glob("v*/manifest.json"))]
    for manifest in manifests[1:]:
        assert manifest["parent_version"] == manifest["version"] - 1 and manifest["iteration"] == manifest["version"]
    assert not list((run_root / "weights" / ".staging").glob("*"))
    assert _mlflow_steps(run_root, "reward/mean", store) == list(range(1, iterations + 1))
    eval_steps = _mlflow_steps(run_root, "eval/accuracy_greedy", store)
    assert eval_steps == sorted(set(eval_steps)) and eval_steps[0] == 0 and eval_steps[-1] == iterations


def test_run_the_loop_and_continue_it(tmp_path: Path):
    """The whole loop, then the same spec file again with more iterations: it continues. The spec
    says `model.warm_start.target_accuracy: null` (run max_steps), a null every KFP step must parse
    as null, not as the default 0.4, or the unchanged spec file would be refused on resume."""
    warm_start = {"max_steps": 5, "batch_size": 8, "validation_size": 8, "target_accuracy": None}
    spec = _write_spec(tmp_path, model={"warm_start": warm_start})
    assert "target_accuracy: null" in spec.read_text()
    run_dir = tmp_path / "run"
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MLflow run: mlflow ui --backend-store-uri sqlite:///" in result.stdout
    said = result.stdout.splitlines()  # the plain display: each iteration and each eval once
    assert [line.split()[1] for line in said if line.startswith("iteration ")] == ["0/3", "1/3", "2/3", "3/3"]
    evals = [line.split("(iteration ")[1] for line in said if "held-out greedy accuracy" in line]
    assert evals == ["0)", "2)", "3)"]
    _check_consistent(run_dir, 3)
    # the prepare step rewrote spec.json with the spec it parsed from its KFP parameter
    assert json.loads((run_dir / "spec.json").read_text())["model"]["warm_start"]["target_accuracy"] is None
    # running the same spec file again with more iterations continues from state.json
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir), "--iterations", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(run_dir, 4)
    # a pipeline run once the loop is done (what a recurring run does) changes nothing
    before = (run_dir / "state.json").read_text()
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir), "--iterations", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((run_dir / "state.json").read_text())["iteration"] == json.loads(before)["iteration"]
    _check_consistent(run_dir, 4)
    # each step's KFP Metrics artifact (what the KFP UI shows) carries its metrics; kfp.local keeps
    # one output directory per task name, so unrolled iterations of one pipeline run share it
    outputs = [json.loads(p.read_text()) for p in (run_dir / "kfp").glob("*/update/executor_output.json")]
    assert len(outputs) == 3  # three pipeline runs that iterated (the fourth had nothing to do)
    assert all("policy/loss" in o["artifacts"]["metrics"]["artifacts"][0]["metadata"] for o in outputs)
    _check_reports(run_dir)


def _reports(run_dir: Path, task: str, output: str) -> list[str]:
    """A Markdown output of every `task` task of every pipeline run: <pipeline root>/<pipeline run>/
    [<iteration pipeline>/]<task>[-k]/<output> (kfp.local; `rlpipe run` puts the pipeline root in kfp/)."""
    found = (run_dir / "kfp").glob(f"**/{output}")
    return [path.read_text() for path in found if re.fullmatch(rf"{task}(-\d+)*", path.parent.name)]


def _check_reports(run_dir: Path) -> None:
    """The KFP UI's Markdown reports of the iterations' advantages, sync-weights and evaluate tasks agree
    with the committed metrics."""
    metrics = {kind: list_metrics(str(run_dir), kind) for kind in ("iter", "eval")}
    samples = _reports(run_dir, "advantages", "rollout_samples")
    assert len(samples) >= 4  # iterations 1 and 2 of the first pipeline run, 3 and 4 of the others
    for text in samples:
        iteration = int(re.match(r"## Rollouts of iteration (\d+)", text).group(1))
        assert f"Reward: mean {metrics['iter'][iteration]['reward/mean']:.4g}," in text
        counts = re.findall(r"^\| \S+ \| (\d+) \| [\d.]+% \|", text.split("### Reward distribution")[1], re.M)
        assert sum(map(int, counts)) == 8 * 4  # prompts_per_iteration x samples_per_prompt
        assert "### Best groups" in text and "### Worst groups" in text
    times = _reports(run_dir, "sync-weights", "time_breakdown")
    assert len(times) >= 4
    for text in times:
        iteration = int(re.match(r"## Where iteration (\d+)'s time went", text).group(1))
        assert "| `time/update_s` | compute |" in text and "| `overhead/update_import_s` | overhead |" in text
        assert f"**{metrics['iter'][iteration]['time/iteration_wall_s']:.3f}**" in text
    evaluated = set()
    for text in _reports(run_dir, "evaluate", "eval_samples"):
        iteration = int(re.match(r"## Held-out eval of iteration (\d+)", text).group(1))
        evaluated.add(iteration)
        assert f"**{metrics['eval'][iteration]['eval/accuracy_greedy']:.4f}**" in text
        rows = read_eval_samples(str(run_dir), iteration)
        assert len(rows) == 20 and f"of {len(rows)} rows fully correct" in text
        assert sum(r["reward"] for r in rows) / len(rows) == metrics["eval"][iteration]["eval/accuracy_greedy"]
        assert sum(r["strict"] for r in rows) / len(rows) == metrics["eval"][iteration]["eval/accuracy_strict"]
    assert evaluated == set(metrics["eval"]) == {0, 2, 3, 4}


def test_bad_spec_fails_before_anything_runs(tmp_path: Path):
    data = tiny_spec_dict(tmp_path)
    data["rollout"]["engine"] = "jax"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    result = _rlpipe("run", str(tmp_path / "bad.yaml"), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "rollout.engine: must be one of 'torch'" in result.stderr
    assert not (tmp_path / "run").exists()


def test_missing_model_path_says_what_to_change(tmp_path: Path):
    spec = _write_spec(tmp_path, model={"path": str(tmp_path / "missing-model")})
    result = _rlpipe("run", str(spec), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1
    assert "pre-flight check failed" in result.stderr  # before any step runs
    assert f"model.path {tmp_path / 'missing-model'} does not exist" in result.stderr
    assert not (tmp_path / "run" / "state.json").exists()


SCALED = {"weights_dtype": "bfloat16", "full_every": 3, "optimizer_every": 3}  # deltas, state every 3 versions


@pytest.mark.parametrize(
    ("kill_in", "resident", "storage"),
    [
        pytest.param("update", False, {}, marks=pytest.mark.slow),  # the per-step kill: CI's slow step
        ("update", True, {}),  # the driver, the update step and (by PDEATHSIG) the resident trainer
        ("update", True, SCALED),  # ... and the restarted trainer replays v1 from v0 and its recorded batch
        pytest.param("generate", False, {}, marks=pytest.mark.slow),
        pytest.param("sync-weights", False, {}, marks=pytest.mark.slow),
    ],
    ids=["update", "update-resident", "update-resident-scaled", "generate", "sync-weights"],
)
def test_kill_mid_iteration_then_resume(tmp_path: Path, kill_in: str, resident: bool, storage: dict):
    spec = _write_spec(
        tmp_path,
        loop={"iterations": 4, "iterations_per_run": 4, "eval_every": 2},
        trainer={"resident": resident},
        storage=storage,
    )
    run_dir = tmp_path / "run"
    log = run_dir / "logs" / "kfp-local.log"
    proc = subprocess.Popen(
        [*RLPIPE, "run", str(spec), "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    marker = f"Executing task \x1b[96m'{kill_in}-2'"  # the second iteration's step
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and marker in log.read_text(errors="replace"):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the running step, like a preempted node
    proc.wait()
    killed_at = json.loads((run_dir / "state.json").read_text())["iteration"]
    assert 1 <= killed_at < 4  # the kill landed mid-loop
    if resident:
        orphan = json.loads((run_dir / "trainers" / "fleet.json").read_text())["replicas"][0]["pid"]

    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(run_dir, 4)
    if storage:
        metrics = json.loads((run_dir / "metrics" / f"iter_{killed_at + 1:06d}.json").read_text())
        assert metrics["trainer/replay_exact"] == 1.0 and metrics["trainer/replayed_updates"] >= 1, metrics
    if resident:  # the killed driver's trainer is gone, and so is the resumed run's
        trainer = json.loads((run_dir / "trainers" / "fleet.json").read_text())["replicas"][0]
        assert trainer["state"] == "stopped"
        for pid in (orphan, trainer["pid"]):
            cmdline = Path(f"/proc/{pid}/cmdline")
            assert not cmdline.exists() or b"rlpipe.services.trainer.server" not in cmdline.read_bytes(), (
                f"trainer {pid} lives"
            )


REWARD_MODULE = '''
def digits_close(prompts, completions, answer, **columns):
    """1.0 for the answer, 0.5 when it shares the first character, else 0.1 (a reward of the user's own)."""
    assert len(columns["id"]) == len(completions)  # every other data column arrives too
    return [1.0 if c.strip() == a else 0.5 if c.strip()[:1] == a[:1] else 0.1 for c, a in zip(completions, answer)]
'''


def test_your_own_data_reward_and_chat_model(tmp_path: Path):
    """Prompts from JSONL chat messages, a reward `module:function` from a module outside the package
    (beside the spec, in the working directory), and a Qwen2-shaped model with a BPE tokenizer trained
    here that carries a chat template: the whole loop on kfp.local."""
    import pyarrow.parquet as pq

    from rlpipe.models.loading import build_bpe_tokenizer, build_tiny_model
    from rlpipe.spec import TinyModelSpec

    rows = [
        {"id": 100 * a + b, "messages": [{"role": "user", "content": f"{a} minus {b}?"}], "answer": str(a - b)}
        for a in range(12)
        for b in range(10)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[20:]))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
    (tmp_path / "my_task_rewards.py").write_text(REWARD_MODULE)
    chats = [
        f"<|im_start|>user\n{a} minus {b}?<|im_end|>\n<|im_start|>assistant\n{a - b}"
        for a in range(30)
        for b in range(30)
    ]
    tokenizer = build_bpe_tokenizer(chats, vocab_size=300)
    shape = TinyModelSpec(
        hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=128
    )
    build_tiny_model(shape, tokenizer, seed=0).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    spec = _write_spec(
        tmp_path,
        model={
            "path": "model",
            "warm_start": {"max_steps": 4, "batch_size": 8, "validation_size": 8, "completion": "{answer}"},
        },
        data={
            "path": "train.jsonl",
            "eval_path": "eval.jsonl",
            "prompt": "messages",
            "system_prompt": "Answer with a number.",
            "max_prompt_tokens": 40,
            "train_size": None,
            "eval_size": None,
        },
        reward={
            "functions": ["my_task_rewards:digits_close"],
            "verifier": {"type": "exact_match", "answer_column": "answer"},
        },
        loop={"iterations": 2, "iterations_per_run": 2, "eval_every": 2},
    )
    result = _rlpipe("run", str(spec), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(tmp_path / "run", 2)
    prepared = pq.read_table(tmp_path / "run" / "data" / "train.parquet").to_pylist()
    assert prepared[0]["prompt"].startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n")
    assert prepared[0]["prompt"].endswith("<|im_start|>assistant\n")
    # prompts over max_prompt_tokens (40) are dropped and counted, as transformers' chat template counts them
    from rlpipe.models.loading import load_tokenizer

    hf = load_tokenizer(tmp_path / "model")
    system = [{"role": "system", "content": "Answer with a number."}]
    texts = [hf.apply_chat_template(system + r["messages"], tokenize=False, add_generation_prompt=True) for r in rows]
    lengths = [len(hf(text, add_special_tokens=False)["input_ids"]) for text in texts]
    kept = [r["id"] for r, n in zip(rows, lengths, strict=True) if n <= 40]
    assert 0 < len(kept) < len(rows)
    assert sorted(r["id"] for r in prepared) == sorted(i for i in kept if i not in {r["id"] for r in rows[:20]})
    scored = [pq.read_table(p).to_pylist() for p in (tmp_path / "run" / "kfp").glob("*/*/score-*/scored")]
    scored += [pq.read_table(p).to_pylist() for p in (tmp_path / "run" / "kfp").glob("*/score/scored")]
    assert len(scored) == 2  # one scored batch per iteration
    for row in scored[0]:
        completion, answer = row["completion"].strip(), row["answer"]
        expected = 1.0 if completion == answer else 0.5 if completion[:1] == answer[:1] else 0.1
        assert row["reward"] == row["reward/digits_close"] == expected
        assert row["prompt"].startswith("<|im_start|>system") and "messages" in row
    metrics = json.loads((tmp_path / "run" / "metrics" / "iter_000000.json").read_text())
    assert metrics["data/train_rows"] == len(prepared) and metrics["data/dropped_too_long"] == len(rows) - len(kept)


@pytest.mark.slow
def test_update_in_two_torchrun_processes(tmp_path: Path):
    """trainer.gpus: 2: the update step runs FSDP2 under torchrun (2 gloo processes here) inside kfp.local."""
    spec = _write_spec(tmp_path, trainer={"gpus": 2, "micro_batch_tokens": 64}, loop={"iterations": 1})
    result = _rlpipe("run", str(spec), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(tmp_path / "run", 1)
    metrics = json.loads((tmp_path / "run" / "metrics" / "iter_000001.json").read_text())
    assert metrics["policy/processes"] == 2 and metrics["policy/optimizer_steps"] == 2
    assert (tmp_path / "run" / "optimizer").exists()


def test_containers_without_an_engine_say_what_to_do(monkeypatch, tiny_spec, tmp_path: Path):
    """`rlpipe run --containers` on a machine with neither Docker nor Podman: what to install, at once."""
    from rlpipe.pipelines.local_runner import containers
    from rlpipe.pipelines.local_runner.step_forks import StepLaunches

    monkeypatch.setattr(containers.shutil, "which", lambda name: None)
    with pytest.raises(containers.ContainersUnavailable, match=r"needs Docker .* or Podman on PATH: install one"):
        containers.start_containers(tiny_spec, str(tmp_path / "run"), {}, StepLaunches())


def test_fused_steps_run_each_iteration_in_one_task(tmp_path: Path):
    """loop.fuse_steps: one KFP task an iteration (its eval included) computes what a task a step does, bit
    for bit: the same weights, rewards and held-out accuracy; its KFP outputs are the steps' artifacts,
    reports and metrics."""
    runs = {}
    for fused in (False, True):
        loop = {"iterations": 2, "iterations_per_run": 2, "eval_every": 2, "fuse_steps": fused}
        spec = _write_spec(tmp_path, loop=loop)  # the same warm-start cache: the same v0
        run_dir = tmp_path / f"run-{fused}"
        result = _rlpipe("run", str(spec), "--run-dir", str(run_dir))
        assert result.returncode == 0, result.stdout + result.stderr
        _check_consistent(run_dir, 2)
        runs[fused] = run_dir
    manifests = {f: json.loads((d / "weights" / "v000002" / "manifest.json").read_text()) for f, d in runs.items()}
    assert manifests[True]["sha256"] == manifests[False]["sha256"]
    for kind, key in (("iter", "reward/mean"), ("eval", "eval/accuracy_greedy")):
        split, fused = (list_metrics(str(runs[f]), kind) for f in (False, True))
        assert {n: m[key] for n, m in fused.items() if key in m} == {n: m[key] for n, m in split.items() if key in m}
    tasks = {p.parent.name for p in (runs[True] / "kfp").glob("**/executor_output.json")}
    assert {"iteration", "iteration-2"} <= tasks and not {"generate", "update", "sync-weights"} & tasks
    outputs = json.loads(next((runs[True] / "kfp").glob("**/iteration-2/executor_output.json")).read_text())
    assert "policy/loss" in outputs["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    [rollouts] = (runs[True] / "kfp").glob("**/iteration-2/rollouts")
    assert rollouts.read_bytes()[:4] == b"PAR1"
    [samples] = (runs[True] / "kfp").glob("**/iteration-2/eval_samples")  # the last iteration: an eval was due
    assert "## Held-out eval of iteration 2" in samples.read_text()
