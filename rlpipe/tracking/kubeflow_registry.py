"""The Kubeflow Model Registry (Kubeflow Hub; `tracking.model_registry`): each version the MLflow registry
gets is registered there too, through the Kubeflow SDK's ModelRegistryClient (`pip install
'rlpipe[kubeflow-hub]'`, which pulls `kubeflow[hub]`): registered model = tracking.registered_model (default:
the run's name), version `v<weights version>`, one model artifact whose uri is the version's source (the URI
MLflow registers: gs://..., s3://..., pvc://<claim>/<path>), and the run, the MLflow run, the iteration, the
sha256 and the eval metrics as the version's metadata (customProperties).

A serving team reads it back with the same client: `get_model_artifact(name, "vN").uri` is what KServe's
storageUri names (`rlpipe export` prints the names). The track step registers after MLflow has: a registry
that fails leaves MLflow's record whole and fails the step with an error naming tracking.model_registry; the
next track step registers what is missing, and never a version twice.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from rlpipe.spec.placement import ModelRegistrySpec
from rlpipe.store.run_root import filesystem, join
from rlpipe.store.weights import ADAPTER_CONFIG, BASE_FILE, read_manifest

if TYPE_CHECKING:
    from kubeflow.hub import ModelRegistryClient

KEY = "tracking.model_registry"
WHOLE, ADAPTER, DELTA = "huggingface", "peft-lora", "rlpipe-delta"  # the artifacts' model_format_name


class RegistryError(RuntimeError):
    """The Kubeflow Model Registry refused or could not be reached; the message names tracking.model_registry."""


def version_name(weights_version: int) -> str:
    """A registered version's name: the weights version it points at (`rlpipe export --version N`)."""
    return f"v{weights_version}"


def connect(settings: ModelRegistrySpec) -> ModelRegistryClient:
    """The SDK's client for the configured registry. Its constructor already asks the server for a model
    (an unreachable registry fails here). Without token_env the SDK reads its own token files."""
    try:
        from kubeflow.hub import ModelRegistryClient
    except ImportError as err:
        raise RegistryError(f"{KEY} needs the Kubeflow SDK: pip install 'rlpipe[kubeflow-hub]' ({err})") from None
    token = None
    if settings.token_env:
        token = os.environ.get(settings.token_env)
        if not token:
            raise RegistryError(f"{KEY}.token_env: the env var {settings.token_env} is not set")
    return ModelRegistryClient(
        settings.server_address,
        port=settings.port,
        author=settings.author,
        is_secure=settings.is_secure,
        user_token=token,
    )


def model_format(weights_uri: str) -> tuple[str, dict[str, Any]]:
    """(model_format_name, what serving must know besides) of a sealed version: `huggingface` for whole
    weights in HF layout (config, tokenizer, model.safetensors: KServe's Hugging Face runtime loads the
    directory); `peft-lora` for a LoRA adapter (rlpipe.base_weights_uri: the base it applies to);
    `rlpipe-delta` for a version stored as a bf16 delta against its parent (`rlpipe export` makes it whole)."""
    fs, adapter = filesystem(join(weights_uri, ADAPTER_CONFIG))
    if fs.exists(adapter):
        base_fs, base_path = filesystem(join(weights_uri, BASE_FILE))
        with base_fs.open(base_path, "r") as f:
            return ADAPTER, {"rlpipe.base_weights_uri": json.load(f)["uri"]}
    delta_of = read_manifest(weights_uri).get("delta_of")
    if delta_of is not None:
        return DELTA, {"rlpipe.delta_of": int(delta_of)}
    return WHOLE, {}


def register(settings: ModelRegistrySpec, name: str, records: list[dict[str, Any]]) -> list[str]:
    """Register each record {version (weights version), uri, weights_uri, metadata} whose version `name`
    lacks; returns the version names registered now. A version there already is left as it is, unless
    another run registered it (an error: two runs must not share a registered model's versions)."""
    if not records:
        return []
    formats = {r["version"]: model_format(r["weights_uri"]) for r in records}  # store errors are not the registry's
    registered: list[str] = []
    try:
        client = connect(settings)
        have = existing_versions(client, name, [version_name(r["version"]) for r in records])
        for record in records:
            version = version_name(record["version"])
            if version in have:
                check_owner(name, version, have[version], record["metadata"])
                continue
            fmt, extra = formats[record["version"]]
            client.register_model(
                name,
                record["uri"],
                version=version,
                model_format_name=fmt,
                version_description=record["description"],
                metadata=record["metadata"] | extra,
            )
            registered.append(version)
    except RegistryError:
        raise
    except Exception as err:  # the SDK raises aiohttp's, its own StoreError, ValueError...
        where = f"{settings.server_address}" + (f" port {settings.port}" if settings.port else "")
        raise RegistryError(
            f"{KEY} ({where}): registering model {name!r} failed (new versions before: {registered or 'none'}): "
            f"{type(err).__name__}: {err}. MLflow's registry has every version; the next track step retries"
        ) from err
    return registered


def existing_versions(client: ModelRegistryClient, name: str, versions: list[str]) -> dict[str, dict[str, Any]]:
    """{version name: its metadata} of `versions` that model `name` has (none when there is no such model)."""
    try:
        client.get_model(name)
    except ValueError:  # the SDK's "not found"
        return {}
    have = {}
    for version in versions:
        try:
            have[version] = client.get_model_version(name, version).custom_properties or {}
        except ValueError:
            continue
    return have


def check_owner(name: str, version: str, have: dict[str, Any], mine: dict[str, Any]) -> None:
    """A version registered by another run (another rlpipe.run_uid) under the same name is an error."""
    if have.get("rlpipe.run_uid") not in (None, mine["rlpipe.run_uid"]):
        raise RegistryError(
            f"{KEY}: model {name!r} version {version} belongs to run {have['rlpipe.run_uid']}, not this run "
            f"({mine['rlpipe.run_uid']}): set tracking.registered_model to a name of this run's own"
        )
