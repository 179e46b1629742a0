#!/usr/bin/env bash
# Make a Python 3.11 base image from Debian 12 packages, for machines that cannot pull
# python:3.11-slim (air-gapped clusters, sandboxes). It stands in for the official image in the
# Dockerfiles: `--build-arg BASE_IMAGE=localhost/rlpipe/python:3.11-bookworm`.
#
#   images/base/make-base.sh [TAG]        (podman, or docker where podman is absent)
#
# What makes it equivalent: Debian 12's python3 is 3.11 (the official image's minor version), and
# `python3`, `python` and `pip` on PATH are a virtual environment's at /opt/python, because
# Debian's own pip is "externally managed" (PEP 668), as /usr/local is in the official image.
# It has passwd (useradd) and ca-certificates; apt-get works, from Debian's mirror.
set -euo pipefail
tag="${1:-localhost/rlpipe/python:3.11-bookworm}"
engine="$(command -v podman || command -v docker || true)"
[ -n "$engine" ] || { echo "make-base: neither podman nor docker is installed (images/install-tools.sh)" >&2; exit 1; }
command -v mmdebstrap >/dev/null || { echo "make-base: mmdebstrap is not installed (images/install-tools.sh)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$SECONDS
mmdebstrap --quiet --variant=minbase \
  --include=python3,python3-venv,ca-certificates,passwd \
  --customize-hook='chroot "$1" python3 -m venv /opt/python' \
  --customize-hook='chroot "$1" ln -sf /opt/python/bin/python3 /opt/python/bin/python' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/usr/share/doc "$1"/usr/share/man' \
  bookworm "$work/rootfs.tar"
"$engine" import \
  --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV VIRTUAL_ENV=/opt/python' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$work/rootfs.tar" "$tag" >/dev/null
size="$("$engine" image inspect --format '{{.Size}}' "$tag")"
echo "make-base: $tag ($((size / 1000000)) MB) in $((SECONDS - started)) s"
