"""`sharing`: the trainer and the samplers take turns on one accelerator, and several runs take turns on it by a
lease (docs/sharing-accelerators.md). On a cluster the pods share it through one pre-made DRA ResourceClaim."""

from __future__ import annotations

from typing import Literal

from rlpipe.spec.section import section, setting


@section
class DeviceClaimSpec:
    """The Kubernetes ResourceClaim (resource.k8s.io/v1) the trainer's and the samplers' pods reference, written by
    `rlpipe compile` beside them: `exactly` `count` devices of `device_class` that match `selector`."""

    name: str = setting(
        default="rlpipe-shared-device",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        doc="The ResourceClaim's name (a DNS label); runs that share the device name the same claim",
    )
    device_class: str = setting(
        min_length=1, doc="The DeviceClass of the devices, e.g. gpu.nvidia.com (NVIDIA's DRA driver)"
    )
    selector: str | None = setting(
        default=None,
        doc="A CEL expression a device must satisfy, e.g. "
        'device.attributes["gpu.nvidia.com"].productName == "NVIDIA H100 80GB HBM3"; null: any of the class',
    )
    count: int = setting(default=1, ge=1, doc="How many devices the claim allocates (trainer.gpus of them)")


@section
class SharingSpec:
    """Time-slicing: the phases that use the device never overlap. Before the trainer's update the samplers
    sleep; before they generate again they wake and serve the new version; the resident trainer gives back its
    device memory while they generate. Runs that name the same `lease` take turns the same way."""

    enabled: bool = setting(
        default=False, doc="Share one accelerator between the resident trainer and the samplers, by turns"
    )
    sleep_level: Literal[1, 2] = setting(
        default=2,
        doc="How deeply the samplers sleep (vLLM's POST /sleep): 1 keeps their weights in host memory, 2 discards "
        "them (the next version is loaded on waking anyway); both free the KV cache",
    )
    offload_weights: bool = setting(
        default=False,
        doc="The trainer also moves its weights to host memory between its turns (its optimizer state and "
        "gradients always go)",
    )
    lease: str | None = setting(
        default=None,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        doc="Runs naming the same lease take turns on the device (a Kubernetes Lease on a cluster, a lock file "
        "under sharing.lease_root elsewhere); null: this run has the device to itself",
    )
    lease_root: str | None = setting(
        default=None,
        doc="A directory every run sharing the lease sees (a shared mount); default: storage.root",
    )
    policy: Literal["fifo", "least_recently_served"] = setting(
        default="fifo",
        doc="Who gets the device next: the run waiting longest (fifo), or the one served longest ago",
    )
    lease_duration_s: float = setting(
        default=30.0,
        ge=1.0,
        doc="A holder renews its turn every third of this; one that stops renewing (killed) loses it after this",
    )
    claim: DeviceClaimSpec | None = setting(
        default=None,
        doc="On a cluster: the ResourceClaim the pods share instead of requesting cluster.trainer.accelerator "
        "each; null: the pods request devices of their own",
    )
