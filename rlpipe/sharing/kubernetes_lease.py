"""lease.py's turn (queue, policies, renewal, expiry) on a coordination.k8s.io/v1 Lease, for runs whose processes
are pods: the Lease named `sharing.lease` in the pod's namespace.

Which one a process uses (lease.lease_backend): RLPIPE_LEASE_BACKEND=kubernetes or file when set; otherwise this
one inside a pod (Kubernetes sets KUBERNETES_SERVICE_HOST in every container), the lock file elsewhere. A pod's
service account needs get, create and update on leases (coordination.k8s.io) in its namespace.

The Lease's spec holds lease.py's record (holderIdentity, leaseDurationSeconds, acquireTime, renewTime,
leaseTransitions; times as MicroTime), its annotations the rest as JSON: rlpipe.dev/waiting (the queue) and
rlpipe.dev/last-served (each owner's last turn's end). Every change is a read-modify-write carrying the read's
metadata.resourceVersion, as client-go's: a 409 Conflict means another process wrote first; read again, retry.
Expiry is the record's renewTime + leaseDurationSeconds, as in the file lease: the pods sharing one device run on
its node, on one clock.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rlpipe.sharing.lease import Policy, Record, Transact, Waiter, empty_record, turn

WAITING = "rlpipe.dev/waiting"
LAST_SERVED = "rlpipe.dev/last-served"
POLL_S = 0.25  # a GET per waiter per poll; writes only on a change (enqueue, refresh every duration / 3, take)
CONFLICT_RETRIES = 50
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def kubernetes_lease_turn(
    name: str,
    identity: str,
    owner: str,
    policy: Policy = "fifo",
    duration_s: float = 30.0,
    namespace: str | None = None,
    api: Any = None,
    poll_s: float = POLL_S,
) -> contextlib.AbstractContextManager[None]:
    """A turn on the Lease `name` in `namespace` (default: the pod's); `api` a kubernetes CoordinationV1Api (default:
    the in-cluster configuration in a pod, the kubeconfig elsewhere). leaseDurationSeconds is whole seconds."""
    transact = lease_transact(api or _default_api(), namespace or pod_namespace(), name)
    return turn(transact, Waiter(identity, owner), policy, float(max(1, math.ceil(duration_s))), poll_s)


def pod_namespace() -> str:
    """The namespace of this pod's service account; `default` outside a pod."""
    if SERVICE_ACCOUNT_NAMESPACE.exists():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return "default"


def _default_api() -> Any:
    from kubernetes import client, config

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.CoordinationV1Api(client.ApiClient(configuration))
    return client.CoordinationV1Api(config.new_client_from_config())


def lease_transact(api: Any, namespace: str, name: str) -> Transact:
    """Read-modify-write of the Lease: created on the first change, replaced with the read's resourceVersion."""
    from kubernetes.client.exceptions import ApiException

    def transact(change: Any) -> Any:
        for _ in range(CONFLICT_RETRIES):
            lease = _read(api, namespace, name)
            record = to_record(lease)
            before = copy.deepcopy(record)
            result = change(record)
            if record == before:
                return result
            try:
                _write(api, namespace, name, lease, record)
                return result
            except ApiException as err:
                if err.status != 409:
                    raise _explained(err, namespace, name) from err
            time.sleep(random.uniform(0.0, 0.05))  # 409: another process wrote first (or created it); read again
        raise RuntimeError(f"Lease {namespace}/{name}: {CONFLICT_RETRIES} writes in a row lost to others (409)")

    return transact


def _read(api: Any, namespace: str, name: str) -> Any:
    """The Lease, None when it does not exist yet."""
    from kubernetes.client.exceptions import ApiException

    try:
        return api.read_namespaced_lease(name, namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise _explained(err, namespace, name) from err


def _explained(err: Any, namespace: str, name: str) -> Exception:
    if err.status == 403:
        return PermissionError(
            f"Lease {namespace}/{name}: forbidden ({err.reason}); the pod's service account needs get, create and "
            f"update on leases (apiGroup coordination.k8s.io) in namespace {namespace}"
        )
    return err


def to_record(lease: Any) -> Record:
    """lease.py's record of a V1Lease (an empty one for None)."""
    record = empty_record()
    if lease is None:
        return record
    spec, notes = lease.spec, lease.metadata.annotations or {}
    record["holderIdentity"] = spec.holder_identity or ""
    record["leaseDurationSeconds"] = spec.lease_duration_seconds
    record["acquireTime"] = spec.acquire_time.timestamp() if spec.acquire_time else None
    record["renewTime"] = spec.renew_time.timestamp() if spec.renew_time else None
    record["leaseTransitions"] = spec.lease_transitions or 0
    record["waiting"] = json.loads(notes.get(WAITING, "[]"))
    record["lastServed"] = json.loads(notes.get(LAST_SERVED, "{}"))
    return record


def _write(api: Any, namespace: str, name: str, lease: Any, record: Record) -> None:
    from kubernetes import client

    def micro_time(seconds: float | None) -> datetime | None:
        return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc)

    duration = record["leaseDurationSeconds"]
    spec = client.V1LeaseSpec(
        holder_identity=record["holderIdentity"],
        lease_duration_seconds=None if duration is None else int(duration),
        acquire_time=micro_time(record["acquireTime"]),
        renew_time=micro_time(record["renewTime"]),
        lease_transitions=record["leaseTransitions"],
    )
    metadata = lease.metadata if lease is not None else client.V1ObjectMeta(name=name, namespace=namespace)
    metadata.labels = {**(metadata.labels or {}), "app.kubernetes.io/managed-by": "rlpipe"}
    metadata.annotations = {
        **(metadata.annotations or {}),
        WAITING: json.dumps(record["waiting"], separators=(",", ":")),
        LAST_SERVED: json.dumps(record["lastServed"], separators=(",", ":"), sort_keys=True),
    }
    body = client.V1Lease(api_version="coordination.k8s.io/v1", kind="Lease", metadata=metadata, spec=spec)
    if lease is None:
        api.create_namespaced_lease(namespace, body)
    else:  # metadata.resourceVersion from the read: the server refuses it (409) when another wrote since
        api.replace_namespaced_lease(name, namespace, body)
