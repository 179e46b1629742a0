"""PPO with a critic: GAE, the clipped value loss and explained variance on hand-computed values;
the critic's lineage in the weight store; whole iterations with the values step (in process, on
the resident trainer, and on the KFP local runner); the compiled pipeline."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlpipe.algorithms import compute_advantages, resolve_options
from rlpipe.algorithms.ppo import explained_variance, gae, value_loss
from rlpipe.spec import parse_spec
from rlpipe.steps import iteration_steps

from .conftest import RLPIPE, initialize, tiny_spec_dict

PPO = {"name": "ppo"}


def test_gae_by_hand():
    # r = (0, 0, 1), V = (0.5, 0.6, 0.7), gamma 0.9, lambda 0.8
    # delta_2 = 1 - 0.7 = 0.3;  delta_1 = 0 + 0.9 * 0.7 - 0.6 = 0.03;  delta_0 = 0.9 * 0.6 - 0.5 = 0.04
    # A_2 = 0.3;  A_1 = 0.03 + 0.72 * 0.3 = 0.246;  A_0 = 0.04 + 0.72 * 0.246 = 0.21712
    advantages, returns = gae(np.array([0.0, 0.0, 1.0]), np.array([0.5, 0.6, 0.7]), gamma=0.9, lam=0.8)
    np.testing.assert_allclose(advantages, [0.21712, 0.246, 0.3])
    np.testing.assert_allclose(returns, [0.71712, 0.846, 1.0])
    # gamma = lambda = 1: every A_t is R - V_t (Monte Carlo), every return R
    advantages, returns = gae(np.array([0.0, 0.0, 1.0]), np.array([0.5, 0.6, 0.7]), gamma=1.0, lam=1.0)
    np.testing.assert_allclose(advantages, [0.5, 0.4, 0.3])
    np.testing.assert_allclose(returns, [1.0, 1.0, 1.0])
    # lambda = 0: one-step TD errors
    advantages, _ = gae(np.array([0.0, 1.0]), np.array([0.2, 0.4]), gamma=1.0, lam=0.0)
    np.testing.assert_allclose(advantages, [0.2, 0.6])


def test_clipped_value_loss_by_hand():
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, -1.0]])
    values = torch.tensor([[0.5, 0.1]], requires_grad=True)
    mask = torch.ones(1, 2)
    terms = value_loss(values, old, returns, mask, clip=0.2)
    loss = terms.loss
    # token 0: V moved 0.5 > 0.2, clipped V = 0.2: max((0.5-1)^2, (0.2-1)^2) = 0.64 (the clipped one)
    # token 1: V moved 0.1 within the clip: (0.1+1)^2 = 1.21 both ways;  L = 1/2 (0.64 + 1.21) / 2
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.21) / 2)
    assert terms.clip_fraction.item() == pytest.approx(0.5)
    loss.backward()  # the clipped token gives no gradient: it moved too far already
    assert values.grad[0, 0].item() == 0.0 and values.grad[0, 1].item() == pytest.approx(0.5 * 2 * 1.1 / 2)
    plain = value_loss(values.detach(), old, returns, mask, clip=None).loss
    assert plain.item() == pytest.approx(0.5 * (0.25 + 1.21) / 2)
    masked = value_loss(values.detach(), old, returns, torch.tensor([[1.0, 0.0]]), clip=0.2).loss
    assert masked.item() == pytest.approx(0.5 * 0.64)


def test_explained_variance_by_hand():
    returns = np.array([1.0, 0.0, 1.0, 0.0])
    assert explained_variance(returns, returns) == 1.0
    assert explained_variance(np.full(4, 0.5), returns) == pytest.approx(0.0)  # a constant predicts nothing
    assert explained_variance(np.array([0.5, 0.0, 0.5, 0.0]), returns) == pytest.approx(1 - 0.0625 / 0.25)
    assert explained_variance(np.zeros(2), np.ones(2)) is None  # undefined: the returns do not vary


def test_advantages_step_turns_values_into_whitened_token_advantages(tmp_path: Path):
    spec = parse_spec(tiny_spec_dict(tmp_path, algorithm=PPO))
    options = resolve_options(spec)
    assert (options.gamma, options.lam, options.value_clip, options.critic_lr) == (1.0, 0.95, 0.2, spec.trainer.lr)
    rows = [
        {"group_id": 0, "reward": 1.0, "completion_token_ids": [5, 6], "logprobs": [-1.0, -1.0], "values": [0.2, 0.4]},
        {"group_id": 0, "reward": 0.0, "completion_token_ids": [7], "logprobs": [-1.0], "values": [0.3]},
    ]
    scored = tmp_path / "valued.parquet"
    pq.write_table(pa.Table.from_pylist(rows), scored)
    metrics = compute_advantages(spec, str(scored), str(tmp_path / "batch.parquet"))
    batch = pq.read_table(tmp_path / "batch.parquet").to_pylist()
    # row 0: delta = (0.4 - 0.2, 1 - 0.4) = (0.2, 0.6); A = (0.2 + 0.95 * 0.6, 0.6) = (0.77, 0.6); G = A + V
    # row 1: A = 0 - 0.3 = -0.3; G = 0.  Whitened over the three tokens.
    raw = np.array([0.77, 0.6, -0.3])
    whitened = (raw - raw.mean()) / (raw.std() + 1e-4)
    np.testing.assert_allclose(batch[0]["token_advantages"] + batch[1]["token_advantages"], whitened, rtol=1e-5)
    np.testing.assert_allclose(batch[0]["returns"] + batch[1]["returns"], [0.97, 1.0, 0.0], rtol=1e-6)
    values, returns = np.array([0.2, 0.4, 0.3]), np.array([0.97, 1.0, 0.0])
    assert metrics["critic/explained_variance"] == pytest.approx(explained_variance(values, returns))
    with pytest.raises(ValueError, match="Compile it again"):  # a grpo-compiled pipeline has no values step
        pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "values"} for r in rows]), scored)
        compute_advantages(spec, str(scored), str(tmp_path / "batch.parquet"))


def test_only_ppo_iterations_have_a_values_step(tmp_path: Path):
    assert "values" in iteration_steps(parse_spec(tiny_spec_dict(tmp_path, algorithm=PPO)))
    grpo = iteration_steps(parse_spec(tiny_spec_dict(tmp_path)))
    assert "values" not in grpo and grpo[:3] == ("generate", "score", "advantages")
    with pytest.raises(ValueError, match="algorithm.gamma is not an option of algorithm grpo"):
        resolve_options(parse_spec(tiny_spec_dict(tmp_path, algorithm={"gamma": 0.9})))


def _ppo_spec(tmp_path: Path, **sections):
    return parse_spec(
        tiny_spec_dict(
            tmp_path,
            algorithm=PPO | {"critic_lr": 0.01},
            reward={"functions": [{"type": "tests.toy_plugins:length", "target": 2}]},
            **sections,
        )
    )


def test_ppo_trains_policy_and_critic_as_two_lineages(tmp_path: Path):
    """Whole iterations in process: critic v(N) values the rollouts, v(N+1) of both lineages is
    published, the critic's values move toward the returns, and old critic versions are pruned."""
    from rlpipe import loop
    from rlpipe.rollouts import read_table
    from rlpipe.store.weights import read_weight_ref, version_uri
    from rlpipe.training.critic import load_critic

    spec = _ppo_spec(tmp_path, storage={"root": str(tmp_path / "runs"), "keep_versions": 1})
    run_root, cache = str(tmp_path / "runs" / spec.name), spec.cache_root
    weights = initialize(spec, run_root, cache)
    first_values = None
    for iteration in (1, 2, 3):
        weights, metrics = loop.run_iteration(spec, run_root, weights, iteration, tmp_path, cache)
        valued = read_table(str(tmp_path / "valued.parquet")).to_pylist()
        assert all(len(r["values"]) == len(r["completion_token_ids"]) for r in valued)
        if first_values is None:  # critic v0: the zero head values everything 0
            first_values = [v for r in valued for v in r["values"]]
            assert max(abs(v) for v in first_values) == 0.0
        for key in ("critic/value_loss", "critic/value_mean", "critic/grad_norm", "time/values_s"):
            assert math.isfinite(metrics[key]), key
        critic = read_weight_ref(run_root, iteration, "critic")
        assert critic["version"] == weights["version"] == iteration
    assert not Path(version_uri(run_root, 1, "critic")).exists()  # pruned with the policy's v1
    later = [v for r in read_table(str(tmp_path / "valued.parquet")).to_pylist() for v in r["values"]]
    assert max(abs(v) for v in later) > 0.0  # critic v2 learnt something
    reloaded = load_critic(spec, run_root, 3, cache, trainable=True)
    assert reloaded.optimizer.state  # its AdamW state came back from critic/optimizer/v000003.pt


def test_ppo_on_the_resident_trainer_matches_the_per_step_processes(tmp_path: Path):
    """The resident trainer (critic held in memory beside the policy) values the rollouts and
    trains both to the same v1 and critic v1 as the per-step processes, and v2 from the held ones."""
    import threading

    from rlpipe import loop
    from rlpipe.services.trainer.server import make_server
    from rlpipe.spec import spec_to_dict
    from rlpipe.store.weights import read_weight_ref

    server = make_server("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    shas = []
    try:
        for resident in (False, True):
            root = tmp_path / ("resident" if resident else "per-step")
            spec = _ppo_spec(root)
            if resident:
                data = spec_to_dict(spec)
                data["trainer"] |= {"resident": True, "endpoint": f"http://127.0.0.1:{server.server_address[1]}"}
                spec = parse_spec(data)
            run_root, cache = str(root / "runs" / spec.name), spec.cache_root
            weights = initialize(spec, run_root, cache)
            for iteration in (1, 2):
                weights, metrics = loop.run_iteration(spec, run_root, weights, iteration, root, cache)
            assert metrics.get("trainer/reloaded", 0.0) == 0.0  # v2 came from the held policy and critic
            shas.append((weights["sha256"], read_weight_ref(run_root, 2, "critic")["sha256"]))
    finally:
        server.shutdown()
    assert shas[0] == shas[1]


@pytest.mark.slow
def test_ppo_loop_on_the_kfp_local_runner(tmp_path: Path):
    """`rlpipe run` with algorithm ppo: the DAG has the values step between score and advantages,
    the run completes consistently, and the critic's metrics reach MLflow."""
    from .test_local_runner import _check_consistent, _mlflow_steps, _rlpipe, _write_spec

    spec = _write_spec(tmp_path, algorithm=PPO, loop={"iterations": 2, "iterations_per_run": 2, "eval_every": 2})
    run_dir = tmp_path / "run"
    result = _rlpipe("run", str(spec), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_consistent(run_dir, 2)
    assert _mlflow_steps(run_dir, "critic/value_loss") == [1, 2]
    assert "time/values_s" in json.loads((run_dir / "metrics" / "iter_000002.json").read_text())
    assert sorted(p.name for p in (run_dir / "critic").glob("v*")) == ["v000001", "v000002"]
    assert sorted(p.name for p in (run_dir / "critic" / "optimizer").glob("*.pt")) == ["v000002.pt"]
    log = re.sub(r"\x1b\[[0-9;]*m", "", (run_dir / "logs" / "kfp-local.log").read_text())
    assert (
        log.index("Executing task 'score'")
        < log.index("Executing task 'values'")
        < log.index("Executing task 'advantages'")
    )


def test_compiled_ppo_yaml_parses_strictly(tmp_path: Path):
    import subprocess

    import yaml
    from google.protobuf import json_format
    from kfp.pipeline_spec import pipeline_spec_pb2

    from .conftest import REPO

    out = tmp_path / "ppo.yaml"
    command = [*RLPIPE, "compile", str(REPO / "examples" / "addition.yaml")]
    command += ["-o", str(out), "--run-root", "gs://bucket/runs/ppo", "--set", "algorithm.name=ppo"]
    command += ["--set", "trainer.endpoint=http://rlpipe-trainer.rlpipe.svc.cluster.local:8001"]
    subprocess.run(command, check=True)
    spec = json_format.ParseDict(yaml.safe_load_all(out.read_text()).__next__(), pipeline_spec_pb2.PipelineSpec())
    assert "exec-values" in spec.deployment_spec["executors"]
    iteration = spec.components["comp-rlpipe-iteration"].dag.tasks
    # advantages reads the values step's output (scored rollouts with V_t), not score's
    scored = iteration["advantages"].inputs.artifacts["scored"].task_output_artifact
    assert (scored.producer_task, scored.output_artifact_key) == ("values", "valued")
    assert iteration["values"].inputs.artifacts["scored"].task_output_artifact.producer_task == "score"
    # its metrics reach the iteration's record
    assert iteration["sync-weights"].inputs.parameters["values_metrics"].task_output_parameter.producer_task == "values"


def test_the_memory_plan_counts_the_critic(tmp_path: Path):
    from rlpipe.training.memory_estimate import estimate_memory, model_shape

    def rows(spec):
        return dict(estimate_memory(spec, model_shape(spec, tmp_path), 64, gpus=2, gpu_memory_gib=80).rows)

    ppo = parse_spec(tiny_spec_dict(tmp_path, algorithm=PPO))
    shape = model_shape(ppo, tmp_path)
    assert rows(ppo)["critic: weights, gradients, AdamW"] == 16 * shape.parameters / 2
    assert not any(what.startswith("critic") for what in rows(parse_spec(tiny_spec_dict(tmp_path))))


@pytest.mark.slow
def test_ppo_update_in_two_torchrun_processes(tmp_path: Path):
    """trainer.gpus: 2 (gloo processes here): FSDP2 shards the critic too; the first process publishes
    critic v1 (whole weights) and its AdamW state, which one process loads and trains on."""
    from rlpipe import loop
    from rlpipe.spec import spec_to_dict
    from rlpipe.store.weights import read_weight_ref
    from rlpipe.training.critic import load_critic

    spec = _ppo_spec(tmp_path)
    run_root, cache = str(tmp_path / "runs" / spec.name), spec.cache_root
    weights = initialize(spec, run_root, cache)
    data = spec_to_dict(spec)
    data["trainer"] |= {"gpus": 2, "device": "cpu", "micro_batch_tokens": 64}
    two = parse_spec(data)
    weights, metrics = loop.run_iteration(two, run_root, weights, 1, tmp_path, cache)
    assert metrics["policy/processes"] == 2 and math.isfinite(metrics["critic/value_loss"])
    assert read_weight_ref(run_root, 1, "critic")["version"] == 1
    critic = load_critic(spec, run_root, 1, cache, trainable=True)  # one process, from the 2-process save
    assert critic.optimizer.state and float(critic.model.score.weight.abs().max()) > 0  # the head trained
