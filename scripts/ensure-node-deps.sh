#!/usr/bin/env bash
# Installs the Node.js publisher example's dependencies (the mongodb driver, pinned by its
# package-lock.json) into a cache outside the repository, with the example next to them.
# Idempotent. Prints the path of the runnable publish.mjs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/cache.sh"
source_dir="$root/examples/publishers/node"
dir="$cache/node-publisher-$(sha256sum "$source_dir/package-lock.json" | cut -c1-12)"
install_once "$dir" npm_ci "$source_dir"
# ES modules resolve packages next to the importing file: run the example from there.
cp "$source_dir/publish.mjs" "$dir/publish.mjs"
echo "$dir/publish.mjs"
