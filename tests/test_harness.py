"""evaluation.harness: EleutherAI's lm-evaluation-harness (lm_eval 0.4.13) run on a version with the eval,
offline on a task defined in local files; its score lands in metrics/eval_N.json, MLflow, the registered
version's tags and the eval gate."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlpipe.spec import SpecError, parse_spec

from .conftest import tiny_spec_dict

TASK = """\
task: rlpipe_doubles
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def test_lm_eval_results_become_metrics():
    from rlpipe.evaluation.harness import harness_metrics

    results = {
        "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.01},
        "local": {"alias": "local", "exact_match,none": 0.5, "exact_match_stderr,none": "N/A", "sample_len": 10},
    }
    assert harness_metrics(results) == {
        "harness/gsm8k/exact_match_strict-match": 0.25,
        "harness/local/exact_match": 0.5,
    }


def test_the_harness_needs_tasks_and_runs_at_the_last_eval_and_every_n(tmp_path: Path):
    from rlpipe.evaluation.harness import harness_due

    with pytest.raises(SpecError, match="evaluation.harness.tasks: must not be empty"):
        parse_spec(tiny_spec_dict(tmp_path, evaluation={"harness": {"tasks": []}}))
    loop = {"iterations": 12, "eval_every": 2}
    every_4 = parse_spec(tiny_spec_dict(tmp_path, loop=loop, evaluation={"harness": {"tasks": ["x"], "every": 4}}))
    assert [n for n in range(13) if harness_due(every_4, n)] == [0, 4, 8, 12]
    last = parse_spec(tiny_spec_dict(tmp_path, loop=loop, evaluation={"harness": {"tasks": ["x"]}}))
    assert [n for n in range(13) if harness_due(last, n)] == [12]


def test_the_harness_runs_offline_with_the_eval_and_its_score_lands_in_mlflow_the_registry_and_the_gate(tmp_path: Path):
    from rlpipe.evaluation.stopping import gate_passed
    from rlpipe.loop import evaluate, prepare, sync_weights
    from rlpipe.store.weights import read_weight_ref
    from rlpipe.tracking.mlflow_runs import flush
    from rlpipe.training.warm_start import warm_start

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = tasks / "doubles.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(10)))
    (tasks / "doubles.yaml").write_text(TASK.format(rows=rows))
    harness = {"tasks": ["rlpipe_doubles"], "include_path": str(tasks), "every": 2, "max_gen_toks": 6}
    spec = parse_spec(tiny_spec_dict(tmp_path, evaluation={"harness": harness}))
    run_root, cache = str(tmp_path / "runs" / "tiny"), str(tmp_path / "cache")
    prepare(spec, run_root)
    staged, metrics = warm_start(spec, run_root, cache)
    sync_weights(spec, run_root, staged, 0, metrics)

    measured = evaluate(spec, run_root, read_weight_ref(run_root, 0), 0, cache)
    score = measured["harness/rlpipe_doubles/exact_match"]
    assert 0.0 <= score <= 1.0
    assert json.loads((Path(run_root) / "metrics" / "eval_000000.json").read_text()) == measured

    done = flush(spec, run_root)
    client = MlflowClient(f"sqlite:///{Path(run_root) / 'mlflow.db'}")
    (point,) = client.get_metric_history(done["run_id"], "harness/rlpipe_doubles/exact_match")
    assert (point.step, point.value) == (0, score)
    registered = client.get_model_version_by_alias("tiny", "best")
    assert registered.tags["harness/rlpipe_doubles/exact_match"] == f"{score:.4f}"

    gate = {"stop_when": f"harness/rlpipe_doubles/exact_match >= {score}"}
    data = tiny_spec_dict(tmp_path, evaluation={"harness": harness}, loop=gate)
    assert gate_passed(parse_spec(data), measured) == f"harness/rlpipe_doubles/exact_match {score:.4g} >= {score:g}"

    # outside the loop, on a chosen version: `rlpipe harness RUN --version N`
    from .test_local_runner import _rlpipe

    client.delete_model_version_tag("tiny", registered.version, "harness/rlpipe_doubles/exact_match")
    result = _rlpipe("harness", run_root, "--version", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"v0  harness/rlpipe_doubles/exact_match  {score:.4f}" in result.stdout  # greedy: the same score
    assert json.loads((Path(run_root) / "metrics" / "harness_v000000.json").read_text()) == {
        "harness/rlpipe_doubles/exact_match": score
    }
    steps = [m.step for m in client.get_metric_history(done["run_id"], "harness/rlpipe_doubles/exact_match")]
    assert steps == [0, 0]  # the eval's point, and this run's
    tags = client.get_model_version("tiny", registered.version).tags
    assert tags["harness/rlpipe_doubles/exact_match"] == f"{score:.4f}"
