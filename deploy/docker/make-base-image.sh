#!/usr/bin/env bash
# Makes the Python base image the Dockerfile's stages build on (its PYTHON_IMAGE), from Debian's
# own packages, for a machine that can reach Debian's mirror and PyPI but no image registry (no
# `docker pull`): debootstrap a minimal bookworm with python3 and its venv module, then import
# that tree as an image. Debian's Python is 3.11, the project's oldest supported one.
#
#   deploy/docker/make-base-image.sh [TAG]      (root; needs debootstrap and a Docker engine)
#
# CA_BUNDLE (default: the host's /etc/ssl/certs/ca-certificates.crt) is copied in as the bundle
# pip verifies its index with (PIP_CERT): where a proxy re-signs TLS, only the host's bundle knows
# its CA. Kept beside Debian's own bundle, which the image's package installs can regenerate.
# Idempotent: an existing TAG is kept (REBUILD=1 makes it again).
set -euo pipefail

TAG=${1:-llmserve-local/python:3.11-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
HOST_BUNDLE=/etc/ssl/certs/host-ca-bundle.crt

if [ "${REBUILD:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "make-base-image: $TAG exists (REBUILD=1 makes it again)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "make-base-image: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
started=$(date +%s)
echo "make-base-image: debootstrap bookworm from $MIRROR into $root"
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
  bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
[ -f "$CA_BUNDLE" ] && cp "$CA_BUNDLE" "$root$HOST_BUNDLE"
# What an image needs no copy of: package lists, caches, documentation.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar --numeric-owner -C "$root" -c . | docker import \
  --change "ENV PIP_CERT=$HOST_BUNDLE" \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$TAG" >/dev/null
echo "make-base-image: $TAG in $(( $(date +%s) - started )) s, $(docker image inspect --format '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1 / 1e6}')"
