#!/usr/bin/env bash
# Builds the images `make images` names (deploy/docker/README.md), on a machine with a registry or
# without one. Run from the repository root:
#
#   deploy/docker/build-images.sh VERSION TORCH_VERSION [BAKE_DEFAULT_MODEL]
#
#   PYTHON_IMAGE   the base of every stage. Unset: the Dockerfile's (python:3.12-slim-bookworm)
#                  when it is present or can be pulled, else one made from Debian's packages
#                  (make-base-image.sh, llmserve-local/python:3.11-bookworm).
#   TORCH_WHEELS   a directory holding torch's CPU wheel for the base's Python (torch-VERSION+cpu-
#                  cp3XX-...whl): served to the build over HTTP on 127.0.0.1 instead of PyTorch's
#                  index. Unset: pip's find-links (PIP_FIND_LINKS, or pip config's
#                  global.find-links) where they hold that wheel.
#   CUDA_IMAGE     1: build llmserve/inference (torch from PyTorch's cu130 index) even when that
#                  index does not answer; 0: never. Unset: when it answers.
#   DOCKER_BUILDKIT 0 (default): the classic builder, since Debian's docker.io has no buildx.
#   NETWORK        the builds' network (default host: where Docker has no bridge, the only one
#                  that reaches the registries).
# Prints each image's build time and size.
set -euo pipefail

VERSION=$1
TORCH_VERSION=$2
BAKE_DEFAULT_MODEL=${3:-0}
NETWORK=${NETWORK:-host}
REGISTRY_BASE=python:3.12-slim-bookworm
LOCAL_BASE=llmserve-local/python:3.11-bookworm
here=$(dirname "$0")

docker info >/dev/null 2>&1 || { echo "build-images: no Docker engine answers (docker info failed)" >&2; exit 1; }

if [ -z "${PYTHON_IMAGE:-}" ]; then
  if docker image inspect "$REGISTRY_BASE" >/dev/null 2>&1 || timeout 20 docker pull -q "$REGISTRY_BASE" >/dev/null 2>&1; then
    PYTHON_IMAGE=$REGISTRY_BASE
  else
    echo "build-images: $REGISTRY_BASE cannot be pulled; making a base from Debian's packages"
    "$here/make-base-image.sh" "$LOCAL_BASE"
    PYTHON_IMAGE=$LOCAL_BASE
  fi
fi
py_tag=$(docker run --rm --network none --entrypoint python3 "$PYTHON_IMAGE" -c \
  'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')

# The CPU torch: a local wheel served on loopback, else PyTorch's cpu index.
torch_find_links=
wheel_server=
if [ -z "${TORCH_WHEELS:-}" ]; then
  for dir in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
    if compgen -G "$dir/torch-$TORCH_VERSION+cpu-$py_tag-$py_tag-*.whl" >/dev/null; then TORCH_WHEELS=$dir; break; fi
  done
fi
if [ -n "${TORCH_WHEELS:-}" ]; then
  compgen -G "$TORCH_WHEELS/torch-$TORCH_VERSION+cpu-$py_tag-$py_tag-*.whl" >/dev/null \
    || { echo "build-images: no torch-$TORCH_VERSION+cpu $py_tag wheel in $TORCH_WHEELS" >&2; exit 1; }
  # A fixed port where it is free: the address is a build argument, so a new one each build would
  # rebuild torch's layer every time.
  port=$(python3 -c 'import socket
s = socket.socket()
try:
    s.bind(("127.0.0.1", 38471))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
  python3 -m http.server --bind 127.0.0.1 --directory "$TORCH_WHEELS" "$port" >/dev/null 2>&1 &
  wheel_server=$!
  trap 'kill "$wheel_server" 2>/dev/null || true' EXIT
  torch_find_links=http://127.0.0.1:$port/
  for _ in $(seq 50); do python3 -c "import urllib.request; urllib.request.urlopen('$torch_find_links')" 2>/dev/null && break; sleep 0.1; done
fi

build() {  # TARGET TAG [BUILD ARGS...]
  local target=$1 tag=$2 started
  shift 2
  started=$(date +%s)
  DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} docker build --file deploy/docker/Dockerfile --network "$NETWORK" --target "$target" \
    --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" --build-arg TORCH_VERSION="$TORCH_VERSION" \
    --build-arg BAKE_DEFAULT_MODEL="$BAKE_DEFAULT_MODEL" "$@" --tag "$tag" .
  echo "build-images: $tag in $(( $(date +%s) - started )) s, $(docker image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')"
}

echo "build-images: base $PYTHON_IMAGE ($py_tag)${torch_find_links:+, CPU torch from $TORCH_WHEELS}"
build gateway "llmserve/gateway:$VERSION"
build preprocess "llmserve/preprocess:$VERSION"
build inference "llmserve/inference-cpu:$VERSION" --build-arg TORCH_VARIANT=cpu \
  ${torch_find_links:+--build-arg TORCH_FIND_LINKS="$torch_find_links"}
cuda=${CUDA_IMAGE:-}
if [ -z "$cuda" ]; then
  cuda=0
  timeout 20 python3 -c "import urllib.request; urllib.request.urlopen('https://download.pytorch.org/whl/cu130/torch/')" 2>/dev/null && cuda=1
fi
if [ "$cuda" = 1 ]; then
  build inference "llmserve/inference:$VERSION"
else
  echo "build-images: llmserve/inference:$VERSION (CUDA) not built: PyTorch's cu130 index does not answer here (CUDA_IMAGE=1 forces it)"
fi
