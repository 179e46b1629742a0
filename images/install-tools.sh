#!/usr/bin/env bash
# Install what builds and runs rlpipe's images on a Debian/Ubuntu machine without Docker:
# Podman (runs containers, plays manifests, serves the Docker API KFP's DockerRunner speaks),
# Buildah (builds), runc (the OCI runtime) and mmdebstrap (a Python base image from Debian packages,
# where no registry image can be pulled: images/base/make-base.sh). Idempotent; needs root or sudo.
set -euo pipefail
tools=(podman buildah runc mmdebstrap)
missing=()
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-tools: ${tools[*]} already installed"
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || {
    echo "install-tools: ${missing[*]} missing and this user is not root: install them as root (apt-get install ${missing[*]})" >&2
    exit 1
  }
  sudo="sudo"
fi
command -v apt-get >/dev/null 2>&1 || {
  echo "install-tools: no apt-get here: install ${missing[*]} with this system's package manager" >&2
  exit 1
}
echo "install-tools: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
  podman buildah runc mmdebstrap >/dev/null
