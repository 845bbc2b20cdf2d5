#!/usr/bin/env bash
# Builds the guest SDK, the example plugins and the hostile test plugin from source into
# WebAssembly components (wasm32-wasip2). Idempotent; installs the Rust target if missing.
# Prints the directory holding the .wasm files.
set -euo pipefail
cd "$(dirname "$0")/../plugins"
if ! rustup target list --installed | grep -qx wasm32-wasip2; then
  rustup target add wasm32-wasip2 >&2
fi
cargo build --quiet --target wasm32-wasip2 --release >&2
echo "$PWD/target/wasm32-wasip2/release"
