"""Where the run writes: the run root and the cache, the MLflow tracking store, and the lease runs share."""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlpipe.preflight.probe import PROBE_S, CheckFailed, within
from rlpipe.spec import RunSpec
from rlpipe.store.run_root import filesystem, join

if TYPE_CHECKING:
    from sqlalchemy.engine import URL


def check_run_root(spec: RunSpec, run_root: str) -> str:
    """The run root (and the warm-start cache) can be written."""
    from rlpipe.store.run_root import cache_root_for

    def write_and_remove() -> None:
        fs, path = filesystem(join(run_root, f".preflight-{uuid.uuid4().hex[:8]}"))
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, b"ok")
        fs.rm_file(path)

    try:
        within(PROBE_S, write_and_remove)
    except TimeoutError:
        raise CheckFailed(
            f"storage.root: the run root {run_root} did not answer in {PROBE_S:g} s; check the bucket's name, the "
            "network and the credentials, or point storage.root (or --run-dir) at a local path"
        ) from None
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


def check_lease(spec: RunSpec) -> str:
    """sharing.lease's directory can be locked: a local or mounted path every run sharing it sees (or, in a pod,
    the Kubernetes Lease)."""
    from rlpipe.sharing.lease import check_lease_root, lease_backend, lease_directory

    if problem := check_lease_root(spec):
        raise CheckFailed(problem)
    if lease_backend() == "kubernetes":
        return f"sharing.lease {spec.sharing.lease}: a coordination.k8s.io/v1 Lease"
    directory = lease_directory(spec)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckFailed(f"sharing.lease_root: cannot create {directory} ({err}); name a writable mount") from None
    return f"sharing.lease {spec.sharing.lease}: turns under {directory} ({spec.sharing.policy})"


def check_tracking(spec: RunSpec, run_root: str) -> str:
    """The MLflow tracking URI: a server answers /health; any other URI needs a store in MLflow's
    registry and, for a database (sqlite, postgresql, mysql, mssql), SQLAlchemy's driver for it
    installed (a database server is not connected to; sqlite's directory is created)."""
    from rlpipe.tracking.uri import tracking_uri

    try:
        uri = tracking_uri(spec, run_root)
    except ValueError as err:
        raise CheckFailed(str(err)) from None
    if uri.startswith(("http://", "https://")):
        from rlpipe.http_json import Unreachable, request_json

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


def check_model_registry(spec: RunSpec) -> str:
    """tracking.model_registry: the Kubeflow SDK is installed, token_env is set, and the registry answers
    the client's first request (its constructor asks the server for a registered model)."""
    from rlpipe.tracking.kubeflow_registry import KEY, RegistryError, connect

    settings = spec.tracking.model_registry
    assert settings is not None  # checked only when tracking.model_registry is set (run_checks)
    where = f"{settings.server_address}" + (f" port {settings.port}" if settings.port else "")
    try:
        within(PROBE_S, lambda: connect(settings))
    except RegistryError as err:
        raise CheckFailed(str(err)) from None
    except TimeoutError:
        raise CheckFailed(
            f"{KEY}: the registry at {where} did not answer in {PROBE_S:g} s; fix {KEY}.server_address and port, "
            "or check the network"
        ) from None
    except Exception as err:  # noqa: BLE001 (refused, TLS, 401/403: the SDK's own exception types)
        raise CheckFailed(
            f"{KEY}: the registry at {where} refused the client ({type(err).__name__}: {err}); fix "
            f"{KEY}.server_address, port, is_secure or token_env"
        ) from None
    return f"Kubeflow Model Registry at {where} answers (author {settings.author})"


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
        assert url is not None  # a database URI, and SQLAlchemy is installed (both checked above)
        dialect = url.get_dialect()
    except ArgumentError as err:  # a malformed URL, or a driver name SQLAlchemy has no dialect for
        backend = _scheme(uri).split("+", 1)[0]
        return f"tracking.uri {uri}: SQLAlchemy cannot read it ({err}); the form is {backend}[+DRIVER]://..."
    # SQLAlchemy 2's import_dbapi, 1.4's dbapi (a classmethod there; SQLAlchemy 2's types say the module)
    import_driver: Callable[[], Any] = getattr(dialect, "import_dbapi", None) or getattr(dialect, "dbapi")
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
