#!/usr/bin/env bash
# Builds every plugin in this repository from source into WebAssembly components:
#   - Rust: the guest SDK, the example plugins and the hostile test plugin (wasm32-wasip2);
#   - Python: plugins/python/* with componentize-py (pinned, from PyPI);
#   - JavaScript: plugins/javascript/* with componentize-js's library API (pinned, from npm).
# Tools are installed once into a cache outside the repository; a plugin is rebuilt only
# when its sources or the WIT changed. Prints the directory holding the .wasm files.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/cache.sh"
out="$root/plugins/target/wasm32-wasip2/release"

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
  rustup target add wasm32-wasip2 >&2
fi
# Its own target directory, whatever CARGO_TARGET_DIR says: the components are looked up there.
(cd "$root/plugins" && CARGO_TARGET_DIR="$root/plugins/target" cargo build --quiet --target wasm32-wasip2 --release >&2)

# True when $1 is missing or older than any file under the other arguments.
stale() {
  local target="$1"
  shift
  [ ! -f "$target" ] || [ -n "$(find "$@" -newer "$target" -type f -print -quit)" ]
}

py_tool="$cache/componentize-py-0.25.1"
for dir in "$root"/plugins/python/*/; do
  name="py_$(basename "$dir" | tr '-' '_')"
  if stale "$out/$name.wasm" "$dir" "$root/wit"; then
    install_once "$py_tool" pip_install "componentize-py==0.25.1"
    (cd "$root" && PYTHONPATH="$py_tool" python3 -c 'import sys; from componentize_py import script; sys.argv[0] = "componentize-py"; sys.exit(script())' \
      -d wit -w plugin componentize app -p "$dir" -o "$out/$name.wasm.partial" >&2)
    mv "$out/$name.wasm.partial" "$out/$name.wasm"
  fi
done

js_tool="$cache/componentize-js-0.23.0"
for dir in "$root"/plugins/javascript/*/; do
  name="js_$(basename "$dir" | tr '-' '_')"
  if stale "$out/$name.wasm" "$dir" "$root/wit"; then
    install_once "$js_tool" npm_ci "$root/plugins/javascript"
    cp "$root/plugins/javascript/componentize.mjs" "$js_tool/"
    node "$js_tool/componentize.mjs" "$dir/handler.js" "$root/wit" "$out/$name.wasm.partial" >&2
    mv "$out/$name.wasm.partial" "$out/$name.wasm"
  fi
done

echo "$out"
