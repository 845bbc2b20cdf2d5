#!/usr/bin/env bash
# Installs the Node.js publisher example's dependencies (the mongodb driver, pinned by its
# package-lock.json) into a cache outside the repository, with the example next to them.
# Idempotent. Prints the path of the runnable publish.mjs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${RELAYHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/relayhost}"
source="$root/examples/publishers/node"
dir="$cache/node-publisher-$(sha256sum "$source/package-lock.json" | cut -c1-12)"
if [ ! -f "$dir/.complete" ]; then
  rm -rf "$dir.partial" && mkdir -p "$dir.partial"
  cp "$source/package.json" "$source/package-lock.json" "$dir.partial/"
  (cd "$dir.partial" && npm ci --silent --no-audit --no-fund >&2)
  touch "$dir.partial/.complete"
  rm -rf "$dir" && mv "$dir.partial" "$dir"
fi
# ES modules resolve packages next to the importing file: run the example from there.
cp "$source/publish.mjs" "$dir/publish.mjs"
echo "$dir/publish.mjs"
