"""Accelerators shared by turns (spec section `sharing`, docs/sharing-accelerators.md): the resident trainer and the
samplers never use the device at once, and runs naming one lease take turns on it.

- turns:    `device_turn`, one phase's hold on the device (train or sample), recorded in the run root
- lease:    the lease several runs take turns by (a lock file on storage they all see): the turn, its queue
            (fifo or least recently served), renewal and expiry; `check_lease_root` for the pre-flight
- kubernetes_lease: the same turn on a coordination.k8s.io/v1 Lease, in a pod
"""
