"""tracking.model_registry: the track step registers the versions MLflow's registry gets in the Kubeflow
Model Registry too, through the Kubeflow SDK's ModelRegistryClient, against a stub of the registry's REST
API (tests/model_registry_stub.py: no Model Registry server runs here). The client itself is real."""

import json
import socket
from pathlib import Path

import pytest
from kubeflow.hub import ModelRegistryClient
from mlflow.tracking import MlflowClient

from rlpipe.spec import parse_spec
from rlpipe.store.run_root import eval_metrics_uri, tracked_uri, write_json
from rlpipe.store.weights import publish, read_weight_ref, seal, staging_uri
from rlpipe.tracking.kubeflow_registry import RegistryError, model_format
from rlpipe.tracking.mlflow_runs import flush
from rlpipe.tracking.uri import tracking_uri

from .conftest import set_state, tiny_spec_dict
from .model_registry_stub import API, ModelRegistryStub

TOKEN_ENV = "RLPIPE_TEST_MODEL_REGISTRY_TOKEN"
TOKEN = "sa-token"
PVC = "rlpipe-runs"
STRING = "MetadataStringValue"


def publish_version(run_root: str, version: int, files: dict[str, str]) -> None:
    """A sealed, published weights version holding `files` (the weight store's own seal and publish)."""
    staged = staging_uri(run_root, version)
    Path(staged).mkdir(parents=True)
    for name, text in files.items():
        (Path(staged) / name).write_text(text)
    publish(run_root, seal(staged, version, version, version - 1 if version else None))


def evaluated(run_root: str, iteration: int, accuracy: float) -> None:
    """Iteration `iteration` committed, its version published and evaluated at `accuracy`."""
    publish_version(run_root, iteration, {"config.json": "{}", "model.safetensors": f"weights {iteration}"})
    metrics = {"eval/accuracy_greedy": accuracy, "eval/pass_at_8": accuracy + 0.25, "eval/weights_version": iteration}
    write_json(eval_metrics_uri(run_root, iteration), metrics)
    set_state(run_root, iteration=iteration, weights_version=iteration)


def registry_spec(tmp_path: Path, address: str, port: int):
    """The tiny spec on a cluster PVC mounted at tmp_path, with a Kubeflow Model Registry."""
    registry = {"server_address": address, "port": port, "is_secure": False, "author": "rl-team"}
    return parse_spec(
        tiny_spec_dict(
            tmp_path,
            cluster={"pvc": PVC, "mount_path": str(tmp_path)},
            tracking={"model_registry": registry | {"token_env": TOKEN_ENV}},
        )
    )


@pytest.fixture
def run_root(tmp_path: Path, monkeypatch) -> str:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    root = str(tmp_path / "run")
    set_state(root, iteration=0, weights_version=0)
    return root


def test_registration_sends_what_the_sdk_client_sends_and_reads_back_through_it(tmp_path, run_root):
    """(a) the requests rlpipe's registration makes equal those ModelRegistryClient.register_model makes
    itself with the same arguments; (b) the version's metadata read back through the client has the
    weights URI, the run, the MLflow run, the iteration and the eval metrics."""
    evaluated(run_root, 0, 0.30)
    evaluated(run_root, 1, 0.50)
    with ModelRegistryStub() as stub:
        done = flush(registry_spec(tmp_path, stub.address, stub.port), run_root)
        sent = list(stub.requests)
        reader = ModelRegistryClient(stub.address, port=stub.port, author="reader", is_secure=False, user_token=TOKEN)
        model, version = reader.get_model("tiny"), reader.get_model_version("tiny", "v1")
        artifact = reader.get_model_artifact("tiny", "v1")
    assert done["registered"] == [0, 1] and done["model_registry"] == ["v0", "v1"]
    assert {r["authorization"] for r in sent} == {f"Bearer {TOKEN}"}  # token_env's token
    assert all(r["path"].startswith(API) for r in sent)

    with ModelRegistryStub() as direct:  # the SDK's own calls, the arguments written out here
        client = ModelRegistryClient(
            direct.address, port=direct.port, author="rl-team", is_secure=False, user_token=TOKEN
        )
        for iteration, accuracy in ((0, 0.30), (1, 0.50)):
            weights = read_weight_ref(run_root, iteration)
            client.register_model(
                "tiny",
                f"pvc://{PVC}/run/weights/v{iteration:06d}",
                version=f"v{iteration}",
                model_format_name="huggingface",
                version_description=f"rlpipe run tiny, iteration {iteration}: eval/accuracy_greedy {accuracy:.4f}",
                metadata={
                    "rlpipe.run_uid": "test-run",
                    "rlpipe.run_name": "tiny",
                    "rlpipe.run_root": run_root,
                    "mlflow.run_id": done["run_id"],
                    "rlpipe.iteration": iteration,
                    "rlpipe.weights_version": iteration,
                    "rlpipe.sha256": weights["sha256"],
                    "rlpipe.weights_uri": weights["uri"],
                    "eval/accuracy_greedy": accuracy,
                    "eval/pass_at_8": accuracy + 0.25,
                },
            )
    writes = [(r["method"], r["path"], r["body"]) for r in sent if r["method"] != "GET"]
    assert writes == direct.writes() and len(writes) == 1 + 2 * 2  # the model; a version and its artifact each
    # besides the client's own reads, rlpipe only reads through the client's API (get_model, get_model_version)
    assert {r["path"] for r in sent} == {r["path"] for r in direct.requests}

    # (b) what the client reads back
    assert model.owner == "rl-team" and version.author == "rl-team" and version.registered_model_id == model.id
    metadata = version.custom_properties
    assert metadata["rlpipe.run_uid"] == "test-run" and metadata["mlflow.run_id"] == done["run_id"]
    assert metadata["rlpipe.iteration"] == 1 and metadata["rlpipe.weights_version"] == 1
    assert metadata["eval/accuracy_greedy"] == 0.5 and metadata["eval/pass_at_8"] == 0.75
    assert metadata["rlpipe.sha256"] == read_weight_ref(run_root, 1)["sha256"]
    assert metadata["rlpipe.weights_uri"] == read_weight_ref(run_root, 1)["uri"]
    assert artifact.uri == f"pvc://{PVC}/run/weights/v000001" and artifact.model_format_name == "huggingface"
    # the MLflow registry has the same versions
    spec = registry_spec(tmp_path, "http://127.0.0.1", 1)
    mlflow_versions = MlflowClient(tracking_uri(spec, run_root)).search_model_versions("name = 'tiny'")
    assert sorted(v.tags["rlpipe.weights_version"] for v in mlflow_versions) == ["0", "1"]


def test_a_repeated_track_step_registers_each_version_once(tmp_path, run_root):
    """(c) flush twice: one version each; a later best eval adds only its own version."""
    evaluated(run_root, 0, 0.30)
    with ModelRegistryStub() as stub:
        spec = registry_spec(tmp_path, stub.address, stub.port)
        assert flush(spec, run_root)["model_registry"] == ["v0"]
        writes = stub.writes()
        assert flush(spec, run_root)["model_registry"] == []  # nothing new (tracked.json)
        Path(tracked_uri(run_root)).unlink()  # as after a flush killed before its record: the registry is asked
        assert flush(spec, run_root)["model_registry"] == []
        assert stub.writes() == writes
        evaluated(run_root, 1, 0.20)  # no better: tracking.register best registers nothing
        evaluated(run_root, 2, 0.60)
        assert flush(spec, run_root)["model_registry"] == ["v2"]
        assert sorted(v["name"] for v in stub.versions.values()) == ["v0", "v2"]
        assert len(stub.models) == 1


def test_an_unreachable_registry_names_the_key_and_mlflow_keeps_its_record(tmp_path, run_root):
    """(d) nothing listens at the address: the track step fails naming tracking.model_registry, after
    MLflow's registry got the version; a later track step with the registry up registers it."""
    evaluated(run_root, 0, 0.30)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    spec = registry_spec(tmp_path, "http://127.0.0.1", port)
    with pytest.raises(RegistryError, match=rf"tracking\.model_registry \(http://127\.0\.0\.1 port {port}\)"):
        flush(spec, run_root)
    versions = MlflowClient(tracking_uri(spec, run_root)).search_model_versions("name = 'tiny'")
    assert [v.tags["rlpipe.iteration"] for v in versions] == ["0"]
    with ModelRegistryStub() as stub:
        assert flush(registry_spec(tmp_path, stub.address, stub.port), run_root)["model_registry"] == ["v0"]


def test_rlpipe_check_asks_the_registry_and_names_what_to_fix(tmp_path, run_root, monkeypatch):
    """`rlpipe check`: the registry answers the SDK's client; unreachable, or token_env unset, is a
    failure naming tracking.model_registry and what to change."""
    from rlpipe.preflight import CheckFailed, check_model_registry

    with ModelRegistryStub() as stub:
        line = check_model_registry(registry_spec(tmp_path, stub.address, stub.port))
        assert line == f"Kubeflow Model Registry at {stub.address} port {stub.port} answers (author rl-team)"
        assert stub.requests, "the check asked the registry nothing"
        monkeypatch.delenv(TOKEN_ENV)
        with pytest.raises(CheckFailed, match=rf"tracking\.model_registry\.token_env: the env var {TOKEN_ENV}"):
            check_model_registry(registry_spec(tmp_path, stub.address, stub.port))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(CheckFailed, match=r"tracking\.model_registry: the registry at .* refused the client .*fix"):
        check_model_registry(registry_spec(tmp_path, "http://127.0.0.1", port))


def test_another_runs_version_is_an_error_not_overwritten(tmp_path, run_root):
    evaluated(run_root, 0, 0.30)
    with ModelRegistryStub() as stub:
        spec = registry_spec(tmp_path, stub.address, stub.port)
        flush(spec, run_root)
        for version in stub.versions.values():
            version["customProperties"]["rlpipe.run_uid"] = {"string_value": "other", "metadataType": STRING}
        Path(tracked_uri(run_root)).unlink()  # the registry is asked again
        with pytest.raises(RegistryError, match="belongs to run other.*tracking.registered_model"):
            flush(spec, run_root)


def test_model_format_says_whole_weights_adapters_and_deltas(tmp_path):
    """What a serving team reads as model_format_name: a whole HF directory, a LoRA adapter (with its
    base), or a delta that `rlpipe export` makes whole."""
    root = str(tmp_path / "run")
    publish_version(root, 0, {"config.json": "{}", "model.safetensors": "w"})
    base = read_weight_ref(root, 0)
    adapter = {"adapter_config.json": "{}", "adapter_model.safetensors": "a", "base.json": json.dumps(base)}
    publish_version(root, 1, adapter)
    assert model_format(base["uri"]) == ("huggingface", {})
    assert model_format(read_weight_ref(root, 1)["uri"]) == ("peft-lora", {"rlpipe.base_weights_uri": base["uri"]})
    staged = staging_uri(root, 2)
    Path(staged).mkdir(parents=True)
    (Path(staged) / "delta.safetensors").write_text("d")
    publish(root, seal(staged, 2, 2, 1, {"delta_of": 1, "chain": 1}))
    assert model_format(read_weight_ref(root, 2)["uri"]) == ("rlpipe-delta", {"rlpipe.delta_of": 1})


def test_rlpipe_export_says_where_the_serving_team_finds_the_version(tmp_path, run_root):
    """`rlpipe export` names the registry, the model, the version and the client call that gives the URI."""
    from rlpipe.pipelines.commands.run_roots import _model_registry_lines
    from rlpipe.spec import spec_to_dict

    evaluated(run_root, 0, 0.30)
    evaluated(run_root, 1, 0.20)  # not a new best: not registered
    spec = registry_spec(tmp_path, "https://model-registry.kubeflow.svc.cluster.local", 443)
    write_json(f"{run_root}/spec.json", spec_to_dict(spec))
    lines = _model_registry_lines(run_root, 0, "/tmp/v0")
    assert lines[0] == (
        "Kubeflow Model Registry https://model-registry.kubeflow.svc.cluster.local: model 'tiny', version 'v0' "
        "(huggingface):"
    )
    assert ".get_model_artifact('tiny', 'v0').uri" in lines[1] and "storageUri" in lines[2]
    assert _model_registry_lines(run_root, 1, "/tmp/v1") == []
