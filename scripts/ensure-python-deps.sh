#!/usr/bin/env bash
# Installs the Python packages the examples and tests use (pymongo) into a cache outside
# the repository, pinned. Idempotent. Prints the directory to put on PYTHONPATH.
set -euo pipefail
cache="${RELAYHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/relayhost}"
dir="$cache/python-pymongo-4.20.0"
if [ ! -f "$dir/.complete" ]; then
  rm -rf "$dir.partial"
  python3 -m pip install --quiet --disable-pip-version-check --only-binary=:all: \
    --target "$dir.partial" "pymongo==4.20.0" "dnspython==2.9.2" >&2
  touch "$dir.partial/.complete"
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
fi
echo "$dir"
