"""The weight store: versioned HF-layout weights under the run root, published atomically.

    weights/v000000/  config.json, tokenizer files, model.safetensors, manifest.json
    weights/.staging/v000001-<id>/   written by update (or warm_start), not yet visible
    weights/LATEST    "v000001", moved last

Steps pass a WeightRef {"uri", "version", "sha256"}, never the weights themselves.
Publish = verify sha256 of the staged files, move them to v{N}/, then move LATEST.

A version is whole (model.safetensors, as save_pretrained writes it) or a delta against its parent
(delta.safetensors: the elements whose bits changed, rlpipe.store.weight_deltas), with a whole one at
least every storage.full_every versions. The manifest says which ("delta_of": the parent version,
"chain": deltas since the last whole one) and holds `weights_sha256`, the hash of the tensors' contents:
a reader rebuilds a delta version from its chain (into the cache) and checks that hash. The manifest's
`sha256` covers the stored files, so a changed delta file is named like any other.

A critic (PPO) is a second lineage with the same layout under critic/: critic/v{N}/ is the value
model trained beside policy v{N} (rlpipe.training.critic).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

from rlpipe.store.run_root import atomic_write_text, filesystem, is_local, join, move

MANIFEST = "manifest.json"


class WeightRef(TypedDict):
    uri: str
    version: int
    sha256: str


def as_weight_ref(data: Mapping[str, Any]) -> WeightRef:
    """A WeightRef from a dict that crossed KFP (protobuf Struct turns ints into floats)."""
    try:
        return {"uri": str(data["uri"]), "version": int(data["version"]), "sha256": str(data["sha256"])}
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"not a weights reference {{uri, version, sha256}}: {data!r}") from None


def version_name(version: int) -> str:
    return f"v{version:06d}"


LINEAGES = {"policy": "weights", "critic": "critic"}  # lineage -> its directory under the run root


def weights_root(run_root: str, lineage: str = "policy") -> str:
    return join(run_root, LINEAGES[lineage])


def staging_uri(run_root: str, version: int, lineage: str = "policy") -> str:
    return join(weights_root(run_root, lineage), ".staging", f"{version_name(version)}-{uuid.uuid4().hex[:8]}")


def version_uri(run_root: str, version: int, lineage: str = "policy") -> str:
    return join(weights_root(run_root, lineage), version_name(version))


BASE_FILE = "base.json"  # in an adapter version: the WeightRef of the sealed base it applies to
ADAPTER_CONFIG = "adapter_config.json"  # peft's: marks an adapter version


def adapter_base(local_dir: str | Path) -> WeightRef | None:
    """The sealed base an adapter version (a local directory) applies to; None for full weights."""
    path = Path(local_dir)
    if not (path / ADAPTER_CONFIG).exists():
        return None
    return as_weight_ref(json.loads((path / BASE_FILE).read_text()))


def weights_bytes(uri: str) -> int:
    """Bytes of a version's weight files (safetensors): what a sampler loading it reads."""
    fs, root = filesystem(uri)
    return sum(info["size"] for path, info in fs.find(root, detail=True).items() if path.endswith(".safetensors"))


@contextlib.contextmanager
def staging_dir(run_root: str, version: int, cache_root: str | Path) -> Iterator[tuple[str, str]]:
    """(the staging URI of `version`, a local directory to write it in): the staging directory itself for
    a local run root; else one under the cache, uploaded to the URI when the block ends without error."""
    staged = staging_uri(run_root, version)
    fs, staged_path = filesystem(staged)
    save_dir = staged_path if is_local(staged) else str(Path(cache_root) / "staging" / staged.rsplit("/", 1)[-1])
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    yield staged, save_dir
    if not is_local(staged):
        fs.put(save_dir.rstrip("/") + "/", staged_path, recursive=True)
        shutil.rmtree(save_dir, ignore_errors=True)


def stage_pretrained(
    run_root: str,
    version: int,
    model,
    tokenizer,
    cache_root: str | Path,
    state_dict: dict | None = None,
    base: WeightRef | None = None,
) -> str:
    """`save_pretrained` model + tokenizer into a fresh staging dir (`staging_dir`); `state_dict`: the
    whole weights when the model itself holds only a shard (FSDP); `base`: the sealed version an
    adapter-only model applies to (written as BASE_FILE)."""
    with staging_dir(run_root, version, cache_root) as (staged, save_dir):
        model.save_pretrained(save_dir, state_dict=state_dict)  # a PeftModel saves only its adapters
        tokenizer.save_pretrained(save_dir)
        if base is not None:
            Path(save_dir, BASE_FILE).write_text(json.dumps(base, sort_keys=True))
            Path(save_dir, "README.md").unlink(missing_ok=True)  # peft's model-card template
    return staged


def stage_delta(run_root: str, version: int, config, tokenizer, delta: dict, cache_root: str | Path) -> str:
    """A delta version into a fresh staging dir (`staging_dir`): the model's config and tokenizer, and DELTA_FILE."""
    from rlpipe.store.weight_deltas import DELTA_FILE, write_safetensors

    with staging_dir(run_root, version, cache_root) as (staged, save_dir):
        config.save_pretrained(save_dir)
        tokenizer.save_pretrained(save_dir)
        with open(Path(save_dir, DELTA_FILE), "wb") as f:
            write_safetensors(delta, f, {"format": "rlpipe-delta"})
    return staged


def write_version(
    run_root: str,
    version: int,
    iteration: int,
    parent: int | None,
    model,
    tokenizer,
    cache_root: str | Path,
    state_dict: dict | None = None,
    base: WeightRef | None = None,
    contents: dict | None = None,
) -> WeightRef:
    """The trainer's one call to store a whole version: staged (stage_pretrained) and sealed (seal, with
    `contents`); returns the WeightRef to hand to publish."""
    staged = stage_pretrained(run_root, version, model, tokenizer, cache_root, state_dict, base)
    return seal(staged, version=version, iteration=iteration, parent=parent, contents=contents)


def write_delta_version(
    run_root: str, version: int, iteration: int, parent: int, config, tokenizer, delta: dict, cache_root, contents: dict
) -> WeightRef:
    """The trainer's one call to store a delta version: staged (stage_delta) and sealed (seal, with `contents`)."""
    staged = stage_delta(run_root, version, config, tokenizer, delta, cache_root)
    return seal(staged, version=version, iteration=iteration, parent=parent, contents=contents)


def directory_sha256(uri: str) -> tuple[str, dict[str, str]]:
    """sha256 over (relative name, file sha256) of every file except the manifest, sorted."""
    fs, root = filesystem(uri)
    files: dict[str, str] = {}
    for path in sorted(fs.find(root)):
        name = path[len(root.rstrip("/")) + 1 :]
        if name == MANIFEST:
            continue
        digest = hashlib.sha256()
        with fs.open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        files[name] = digest.hexdigest()
    if not files:
        raise FileNotFoundError(f"no weight files under {uri}")
    total = hashlib.sha256()
    for name, file_sha in files.items():
        total.update(f"{name}\0{file_sha}\n".encode())
    return total.hexdigest(), files


def seal(uri: str, version: int, iteration: int, parent: int | None, contents: dict | None = None) -> WeightRef:
    """Hash a staged directory and write its manifest; returns the WeightRef to hand to publish. `contents`:
    what the trainer knows of the tensors (weights_sha256, weights_dtype, delta_of, chain)."""
    sha, files = directory_sha256(uri)
    manifest = {
        "version": version,
        "iteration": iteration,
        "parent_version": parent,
        "sha256": sha,
        "files": files,
        "created_at": time.time(),
        **(contents or {}),
    }
    atomic_write_text(join(uri, MANIFEST), json.dumps(manifest, indent=2))
    return {"uri": uri, "version": version, "sha256": sha}


class Published(NamedTuple):
    ref: WeightRef  # v{N} in the store
    weight_bytes: int  # its weight files' (safetensors): what a sampler loading it reads


def publish(run_root: str, staged: WeightRef, lineage: str = "policy") -> Published:
    """Verify a staged version and make it v{N}; move LATEST last. Idempotent per version."""
    staged = as_weight_ref(staged)
    version = staged["version"]
    final = version_uri(run_root, version, lineage)
    fs, final_path = filesystem(final)
    sha, _ = directory_sha256(staged["uri"])
    if sha != staged["sha256"]:
        raise ValueError(
            f"staged weights {staged['uri']} have sha256 {sha}, expected {staged['sha256']}: "
            "the update step's output was modified or truncated; rerun the iteration"
        )
    if fs.exists(final_path):  # left by an attempt that died before committing state
        fs.rm(final_path, recursive=True)
    move(staged["uri"], final)
    atomic_write_text(join(weights_root(run_root, lineage), "LATEST"), version_name(version))
    return Published({"uri": final, "version": version, "sha256": sha}, weights_bytes(final))


def read_manifest(uri: str) -> dict:
    fs, path = filesystem(join(uri, MANIFEST))
    with fs.open(path, "r") as f:
        return json.load(f)


def read_weight_ref(run_root: str, version: int, lineage: str = "policy") -> WeightRef:
    uri = version_uri(run_root, version, lineage)
    fs, path = filesystem(join(uri, MANIFEST))
    if not fs.exists(path):
        raise FileNotFoundError(f"weights {uri} have no manifest: version {version} was never published")
    with fs.open(path, "r") as f:
        manifest = json.load(f)
    return {"uri": uri, "version": version, "sha256": manifest["sha256"]}


def latest_version(run_root: str) -> int | None:
    fs, path = filesystem(join(weights_root(run_root), "LATEST"))
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return int(f.read().strip().lstrip("v"))


def check_weight_ref(weight_ref: WeightRef) -> None:
    """Cheap check that a WeightRef points at the published version it claims (manifest, not a re-hash)."""
    weight_ref = as_weight_ref(weight_ref)
    fs, path = filesystem(join(weight_ref["uri"], MANIFEST))
    if not fs.exists(path):
        raise FileNotFoundError(f"weights {weight_ref['uri']} are not published (no manifest)")
    with fs.open(path, "r") as f:
        manifest = json.load(f)
    if manifest["sha256"] != weight_ref["sha256"] or manifest["version"] != weight_ref["version"]:
        raise ValueError(
            f"weights at {weight_ref['uri']} are version {manifest['version']} sha {manifest['sha256'][:12]}, "
            f"but the step was handed version {weight_ref['version']} sha {weight_ref['sha256'][:12]}"
        )


class CorruptWeightsError(ValueError):
    """A sealed version whose files no longer hash to its manifest; the message names them."""


def verify(weight_ref: WeightRef, files_uri: str | None = None) -> None:
    """Re-hash the version's files (at `files_uri`, default the WeightRef's own) against the sealed sha256;
    on a mismatch name the files that differ from the manifest."""
    root = files_uri or weight_ref["uri"]
    sha, files = directory_sha256(root)
    if sha == weight_ref["sha256"]:
        return
    fs, path = filesystem(join(root, MANIFEST))
    with fs.open(path, "r") as f:
        sealed = json.load(f)["files"]
    changed = sorted(name for name in set(files) | set(sealed) if files.get(name) != sealed.get(name))
    raise CorruptWeightsError(
        f"weights version {weight_ref['version']} at {weight_ref['uri']} changed after it was sealed: "
        f"{', '.join(changed)} "
        "differ from its manifest.json. Nothing was trained on them. Restore those files (they are the exact "
        "bytes the manifest's sha256 names), or start a new run (another name) with model.path at an intact version"
    )


def local_path(weight_ref: WeightRef, cache_dir: str | Path) -> str:
    """A local directory holding the WeightRef's whole weights, verified: the stored files against their
    sha256 (the store itself when local, else a cached copy verified when downloaded); a delta version
    rebuilt from its chain into the cache, checked against its weights_sha256."""
    weight_ref = as_weight_ref(weight_ref)
    check_weight_ref(weight_ref)
    stored = stored_path(weight_ref, cache_dir)
    if "delta_of" in (manifest := json.loads(Path(stored, MANIFEST).read_text())) and manifest["delta_of"] is not None:
        return rebuilt_path(weight_ref, manifest, cache_dir)
    return stored


def version_path(run_root: str, version: int, cache_dir: str | Path) -> str:
    """A local directory holding published v(version)'s whole weights, verified (read_weight_ref, local_path)."""
    return local_path(read_weight_ref(run_root, version), cache_dir)


def stored_in(weight_ref: WeightRef, weights_dtype: str, cache_dir: str | Path) -> tuple[dict, str] | None:
    """(the version's manifest, a local directory of its whole weights: local_path) when it is stored in
    `weights_dtype` (its manifest's weights_dtype); else None."""
    manifest = read_manifest(weight_ref["uri"])
    if manifest.get("weights_dtype") != weights_dtype:
        return None
    return manifest, local_path(weight_ref, cache_dir)


def version_chain(weight_ref: WeightRef) -> list[tuple[WeightRef, dict]]:
    """(WeightRef, manifest) of `weight_ref` and each version its delta is against, back to a whole one;
    newest first."""
    chain = [(weight_ref, read_manifest(weight_ref["uri"]))]
    while chain[-1][1].get("delta_of") is not None:
        parent_uri = join(weight_ref["uri"].rsplit("/", 1)[0], version_name(chain[-1][1]["delta_of"]))
        try:
            manifest = read_manifest(parent_uri)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"weights version {weight_ref['version']} is a delta whose chain needs {parent_uri}, which is gone; "
                "a pruned chain should never happen (prune keeps every version a kept one is rebuilt from): "
                "restore that version, or resume from an earlier whole version"
            ) from None
        chain.append(({"uri": parent_uri, "version": manifest["version"], "sha256": manifest["sha256"]}, manifest))
    return chain


def rebuilt_path(weight_ref: WeightRef, manifest: dict, cache_dir: str | Path) -> str:
    """cache/rebuilt/<weights_sha256>/: the delta version `weight_ref` as whole weights (model.safetensors),
    made once from the last whole version before it and the deltas since, and checked against the
    manifest's weights_sha256; the two most recent rebuilt versions are kept."""
    from safetensors.torch import load_file

    from rlpipe.store.weight_deltas import DELTA_FILE, apply_delta, content_sha256, write_safetensors

    rebuilt_root = Path(cache_dir) / "rebuilt"
    out = rebuilt_root / manifest["weights_sha256"]
    if (out / MANIFEST).exists():
        return str(out)
    chain = version_chain(weight_ref)
    whole = Path(stored_path(chain[-1][0], cache_dir))
    tensors: dict = {}
    for file in sorted(whole.glob("*.safetensors")):
        tensors |= load_file(file)
    for link, link_manifest in reversed(chain[:-1]):
        apply_delta(tensors, load_file(Path(stored_path(link, cache_dir), DELTA_FILE)))
        if content_sha256(tensors) != link_manifest["weights_sha256"]:
            raise CorruptWeightsError(
                f"weights version {link['version']} rebuilt from its chain does not hash to its manifest's "
                f"weights_sha256 {link_manifest['weights_sha256'][:12]}: a version in its chain was changed "
                "after it was sealed. Restore it, or resume from an earlier whole version"
            )
    tmp = rebuilt_root / f"{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    shutil.copytree(stored_path(weight_ref, cache_dir), tmp, ignore=shutil.ignore_patterns(DELTA_FILE))
    with open(tmp / "model.safetensors", "wb") as f:
        write_safetensors(tensors, f, {"format": "pt"})
    try:
        tmp.rename(out)
    except OSError:  # another process rebuilt it meanwhile: the same bytes (checked)
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / MANIFEST).exists():
            raise
    rebuilt = [p for p in rebuilt_root.iterdir() if ".tmp-" not in p.name]  # not others' rebuilds in progress
    for stale in sorted(rebuilt, key=lambda p: p.stat().st_mtime)[:-2]:
        shutil.rmtree(stale, ignore_errors=True)
    return str(out)


def stored_path(weight_ref: WeightRef, cache_dir: str | Path) -> str:
    """A local directory holding the weight_ref's stored files (a delta's are its delta), verified against its
    sha256: the store itself when local, else a cached copy (verified when downloaded)."""
    if is_local(weight_ref["uri"]):
        verify(weight_ref)
        return filesystem(weight_ref["uri"])[1]
    local = Path(cache_dir) / "weights" / weight_ref["sha256"]
    if not (local / MANIFEST).exists():
        tmp = local.with_name(f"{local.name}.tmp-{uuid.uuid4().hex[:8]}")
        fs, remote = filesystem(weight_ref["uri"])
        fs.get(remote.rstrip("/") + "/", str(tmp), recursive=True)
        try:
            verify(weight_ref, str(tmp))
        except CorruptWeightsError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        tmp.rename(local)
    return str(local)


def advance_in_place(model: Any, current: WeightRef, new: WeightRef, cache_dir: str | Path) -> bool:
    """Move a model at version `current` (a WeightRef) to `new` by writing in `new`'s delta, when `new`
    is a delta against exactly `current`; the result is checked against `new`'s weights_sha256 (the model's
    weights cast to the version's dtype). False when `new` must be loaded whole instead (not a delta of
    `current`, or the check failed: the model is then neither version)."""
    from safetensors.torch import load_file

    from rlpipe.store.weight_deltas import DELTA_FILE, WEIGHTS_DTYPES, apply_delta_to_model, content_sha256

    chain = version_chain(new)
    if len(chain) < 2 or chain[1][0]["version"] != current["version"] or chain[1][0]["sha256"] != current["sha256"]:
        return False
    delta = load_file(Path(stored_path(new, cache_dir), DELTA_FILE))
    apply_delta_to_model(model, delta)
    manifest = read_manifest(new["uri"])
    dtype = WEIGHTS_DTYPES[manifest["weights_dtype"]]
    state = model.state_dict()
    names = {key.rsplit("#", 1)[0] for key in delta}
    return content_sha256({name: state[name].to(dtype) for name in names}) == manifest["weights_sha256"]
