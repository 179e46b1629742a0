from pathlib import Path

import pytest
import yaml

from rlpipe.spec import SpecError, load_spec, parse_spec, spec_from_json, spec_to_dict

from .conftest import REPO


def test_demo_spec_is_valid():
    spec = load_spec(REPO / "examples" / "addition.yaml")
    assert spec.rollout.samples_per_prompt == 8
    assert spec.trainer.lr == 5e-4


def test_unknown_key_names_the_key_and_the_allowed_keys():
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "trainer": {"learning_rate": 1e-3}})
    message = str(err.value)
    assert "trainer.learning_rate: unknown key" in message
    assert "lr" in message and "max_grad_norm" in message


def test_unknown_top_level_section():
    with pytest.raises(SpecError, match=r"trainr: unknown key; allowed keys here: .*trainer"):
        parse_spec({"name": "x", "trainr": {}})


def test_bad_choice_lists_the_allowed_values():
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "algorithm": {"scale_rewards": "sometimes"}})
    assert "algorithm.scale_rewards" in str(err.value)
    assert "'group'" in str(err.value) and "'none'" in str(err.value)


def test_bad_number_names_the_bound():
    with pytest.raises(SpecError, match=r"rollout.samples_per_prompt: must be >= 2 \(got 1\)"):
        parse_spec({"name": "x", "rollout": {"samples_per_prompt": 1}})


def test_head_size_must_fit_vllm():
    with pytest.raises(SpecError, match="head size"):
        parse_spec({"name": "x", "model": {"tiny": {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2}}})


def test_reward_function_reference_format():
    with pytest.raises(SpecError, match="package.module:function"):
        parse_spec({"name": "x", "reward": {"functions": ["not_a_reference"]}})
    with pytest.raises(SpecError, match="reward.weights has 2 entries"):
        parse_spec({"name": "x", "reward": {"functions": ["a:b"], "weights": [1.0, 2.0]}})


def test_missing_name_and_missing_file(tmp_path: Path):
    with pytest.raises(SpecError, match="name: required"):
        parse_spec({})
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")


def test_overrides(tmp_path: Path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "x"}))
    spec = load_spec(path, {"trainer.lr": 1e-4, "loop.iterations": 7})
    assert spec.trainer.lr == 1e-4 and spec.loop.iterations == 7
    assert parse_spec({"name": "x", "loop": {"iterations": 7.0}}).loop.iterations == 7  # YAML may say 7.0
    with pytest.raises(SpecError, match="trainer.lr: must be a number"):
        parse_spec({"name": "x", "trainer": {"lr": float("inf")}})  # JSON could not carry it


def test_a_parameter_that_is_not_a_spec_says_what_to_pass():
    with pytest.raises(SpecError, match=r"not a run spec's JSON .*rlpipe.spec.spec_to_json"):
        spec_from_json("{'name': 'x'}")


def test_resumed_run_keeps_its_spec(tmp_path: Path):
    from rlpipe.pipelines.local_runner.driver import check_spec_unchanged

    from .conftest import set_state

    run_root = str(tmp_path / "run")
    (tmp_path / "run" / "data").mkdir(parents=True)
    check_spec_unchanged(parse_spec({"name": "x", "data": {"train_size": 10**6}}), run_root)  # init fails later
    # nothing committed yet: a corrected spec replaces it, and data prepared for the old one goes
    check_spec_unchanged(parse_spec({"name": "x"}), run_root)
    assert not (tmp_path / "run" / "data").exists()
    set_state(run_root, iteration=0)  # from here on the spec is locked
    check_spec_unchanged(parse_spec({"name": "x", "loop": {"iterations": 99}}), run_root)  # more iterations: fine
    check_spec_unchanged(parse_spec({"name": "x", "storage": {"root": "/elsewhere"}}), run_root)  # another cwd
    with pytest.raises(ValueError) as refused:
        check_spec_unchanged(parse_spec({"name": "x", "trainer": {"lr": 1e-2}}), run_root)
    assert "trainer.lr: started with 0.0005, now 0.01" in str(refused.value)
    # the engine, the samplers and the threads may change on resume: every engine samples the same policy
    check_spec_unchanged(
        parse_spec({"name": "x", "rollout": {"engine": "sampler"}, "samplers": {"replicas": 4}}), run_root
    )
    check_spec_unchanged(parse_spec({"name": "x", "trainer": {"threads": 2}}), run_root)
    with pytest.raises(ValueError) as refused:
        check_spec_unchanged(
            parse_spec({"name": "x", "rollout": {"engine": "sampler", "temperature": 0.7}, "seed": 3}), run_root
        )
    message = str(refused.value)
    assert "rollout.temperature: started with 1.0, now 0.7" in message and "seed: started with 0, now 3" in message
    assert "rollout.engine" not in message


def test_a_resumed_run_compares_what_the_stored_spec_means(tmp_path: Path):
    """An explicit null is a setting (not its default), and a stored spec is read as parsed."""
    from rlpipe.pipelines.local_runner.driver import check_spec_unchanged
    from rlpipe.store.run_root import write_json

    from .conftest import set_state

    run_root = str(tmp_path / "run")
    unbounded = parse_spec({"name": "x", "model": {"warm_start": {"target_accuracy": None}}})
    check_spec_unchanged(unbounded, run_root)
    set_state(run_root, iteration=1)
    check_spec_unchanged(unbounded, run_root)
    with pytest.raises(ValueError, match="model.warm_start.target_accuracy: started with null, now 0.4"):
        check_spec_unchanged(parse_spec({"name": "x"}), run_root)
    # a spec.json that omits defaults (or writes 7.0 for 7) means the same spec
    write_json(f"{run_root}/spec.json", {"name": "x", "loop": {"iterations": 7.0}})
    check_spec_unchanged(parse_spec({"name": "x"}), run_root)


def test_vllm_engines_refuse_truncated_sampling():
    with pytest.raises(SpecError, match="rollout.top_k: 0 and rollout.top_p: 1.0"):
        parse_spec({"name": "x", "rollout": {"engine": "sampler", "top_k": 5}})
    assert parse_spec({"name": "x", "rollout": {"engine": "torch", "top_k": 5}}).rollout.top_k == 5
    with pytest.raises(SpecError, match="rollout.engine: must be one of 'torch', 'vllm', 'sampler'"):
        parse_spec({"name": "x", "rollout": {"engine": "sglang"}})


def test_values_as_yaml_and_kfp_give_them():
    spec = parse_spec(
        {
            "name": "x",
            "trainer": {"lr": "3e-4", "betas": [0.9, 0.95], "resident": "true"},  # YAML 1.1 reads 3e-4 as a string
            "cluster": {"step": {"image": "i", "tolerations": [{"key": "gpu"}], "node_selector": {"pool": "cpu"}}},
        }
    )
    assert spec.trainer.lr == 3e-4 and spec.trainer.betas == (0.9, 0.95) and spec.trainer.resident is True
    assert spec.cluster.step.tolerations[0].effect == "NoSchedule"
    assert parse_spec(spec_to_dict(spec)) == spec


def test_every_problem_is_listed_at_once():
    with pytest.raises(SpecError) as err:
        parse_spec(
            {
                "name": "has space",
                "seed": 1.5,
                "trainer": {"lr": float("nan"), "betas": [0.9], "resident": 3},
                "reward": {"functions": []},
                "cluster": {"step": {"image": "i", "tolerations": [{"operator": "Equal"}]}},
            }
        )
    lines = str(err.value).splitlines()[1:]
    expected = [
        "name: must match",
        "seed: must be an integer (got 1.5)",
        "reward.functions: must not be empty",
        "trainer.lr: must be a number (got nan)",
        "trainer.betas: must be a list of 2 values",
        "trainer.resident: must be true or false (got 3)",
        "cluster.step.tolerations[0].key: required",
    ]
    assert len(lines) == len(expected)
    for line, start in zip(lines, expected, strict=True):
        assert line.strip().startswith(start), line


def test_a_section_must_be_a_mapping():
    with pytest.raises(SpecError, match=r"trainer: expected a mapping of keys, got 5"):
        parse_spec({"name": "x", "trainer": 5})
    with pytest.raises(SpecError, match=r"<top level>: expected a mapping"):
        parse_spec(["name"])


def test_the_replaced_gpu_keys_say_what_to_write(tmp_path: Path):
    """trainer.gpus is the one count of the trainer's GPUs (gloo processes on CPU): specs that still
    write trainer.processes or cluster.<pod>.gpus are told what to write instead, from a file too."""
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "trainer": {"processes": 4}})
    assert "trainer.processes: replaced by trainer.gpus" in str(err.value)
    assert str(err.value).endswith("write instead:\n    trainer:\n      gpus: 4")
    old = {"name": "x", "cluster": {"trainer": {"image": "t", "gpus": 0}, "step": {"image": "s", "gpus": 0}}}
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(SpecError) as err:
        load_spec(tmp_path / "old.yaml")
    lines = str(err.value).splitlines()
    assert lines[1].strip().startswith("cluster.trainer.gpus: replaced by trainer.gpus")
    assert lines[2:4] == ["    trainer:", "      device: cpu"]  # 0 GPUs: what trainer.device cpu now says
    assert lines[4].strip() == "cluster.step.gpus: removed (steps on the step image compute without torch); delete it"
    with pytest.raises(SpecError, match=r"trainer.nodes > 1 .* set trainer.resident: true, or trainer.nodes: 1"):
        parse_spec({"name": "x", "trainer": {"nodes": 2}})
    spec = parse_spec({"name": "x", "trainer": {"gpus": 8, "nodes": 2, "resident": True}})
    assert (spec.trainer.gpus, spec.trainer.nodes) == (8, 2)


def test_fused_steps_refuse_the_pipelines_that_split_an_iteration():
    for sections in ({"loop": {"max_staleness": 1, "overlap": "dag"}}, {"algorithm": {"name": "dpo"}}):
        loop = {**sections.get("loop", {}), "fuse_steps": True}
        with pytest.raises(ValueError, match="loop.fuse_steps: false"):
            parse_spec({"name": "x", **sections, "loop": loop})
    assert parse_spec({"name": "x", "loop": {"fuse_steps": True, "max_staleness": 1}}).loop.fuse_steps


FLAT_ALGORITHM = {  # the flat `algorithm` section older rlpipe wrote into every spec.json: each option, most null
    **dict.fromkeys(
        "scale_rewards clip_eps clip_eps_high kl_estimator loss_aggregation length_norm dual_clip dynamic_sampling "
        "gamma lam value_clip whiten_advantages critic_lr beta label_smoothing dpo_loss rpo_alpha "
        "off_policy_correction is_level".split()
    ),
    "kl_coef": 0.0,
    "entropy_coef": 0.0,
    "max_oversample": 3.0,
    "track_reference_kl": True,
    "is_threshold": 2.0,
}


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "ppo", "reinforce_pp", "dpo", "online_dpo"])
def test_a_flat_algorithm_section_still_parses_to_the_algorithms_defaults(name: str):
    """A spec.json of an older run (every option of every algorithm, null: the algorithm's default) parses to
    what the algorithm's own options give, so it resumes unchanged; a set option another algorithm takes is named."""
    from rlpipe.spec import resume_changes

    old = {"name": "x", "algorithm": {**FLAT_ALGORITHM, "name": name}}
    new = parse_spec({"name": "x", "algorithm": {"name": name}})
    assert parse_spec(old) == new
    assert resume_changes(old, new) == []
    if name == "dapo":
        assert new.algorithm.clip_eps_high == 0.28  # null was dapo's clip-higher, and is
    other, key = ("grpo", "scale_rewards") if name == "ppo" else ("ppo", "gamma")
    with pytest.raises(SpecError, match=rf"algorithm.{key} is not an option of algorithm {name} .*{other}"):
        parse_spec(
            {"name": "x", "algorithm": {**FLAT_ALGORITHM, "name": name, key: 0.9 if key == "gamma" else "batch"}}
        )
