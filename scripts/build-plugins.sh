#!/usr/bin/env bash
# Builds every plugin in this repository from source into WebAssembly components:
#   - Rust: the guest SDK, the example plugins and the hostile test plugin (wasm32-wasip2);
#   - Python: plugins/python/* with componentize-py (pinned, from PyPI);
#   - JavaScript: plugins/javascript/* with componentize-js's library API (pinned, from npm);
#   - C: plugins/c/* with Debian's clang, lld and wasi-libc, bindings from wit-bindgen's C
#     generator and the component made by wasm-tools with the WASI preview1 adapter (all
#     three pinned, from crates.io).
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

# C: Debian's compiler for wasm32-wasi (installed once, as root; otherwise say what is missing).
c_tools_ready() { command -v clang-14 >/dev/null && command -v wasm-ld >/dev/null && [ -f /usr/include/wasm32-wasi/stdio.h ] && [ -f /usr/lib/llvm-14/lib/clang/14.0.6/lib/wasi/libclang_rt.builtins-wasm32.a ]; }
c_debian_packages="clang-14 lld wasi-libc libclang-rt-14-dev-wasm32"
# cargo_install TARGET CRATE VERSION FEATURES: one pinned tool, only the features it is used for.
cargo_install() {
  CARGO_TARGET_DIR="$1/target" cargo install --quiet --locked --root "$1" "$2" --version "$3" --no-default-features --features "$4"
  rm -rf "$1/target"
}
# adapter TARGET: the WASI preview1 adapter (reactor) of the wasmtime release the host embeds.
adapter() {
  mkdir -p "$1/src" && echo 'fn main() {}' > "$1/src/main.rs"
  printf '[package]\nname = "adapter"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nwasi-preview1-component-adapter-provider = "=48.0.8"\n' > "$1/Cargo.toml"
  local dir
  dir="$(cd "$1" && cargo metadata --quiet --format-version 1 | python3 -c 'import json, sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "wasi-preview1-component-adapter-provider").rsplit("/", 1)[0])')"
  cp "$dir/artefacts/wasi_snapshot_preview1.reactor.wasm" "$1/"
}
wit_bindgen="$cache/wit-bindgen-cli-0.57.1"
wasm_tools="$cache/wasm-tools-1.262.0"
c_adapter="$cache/wasi-preview1-adapter-48.0.8"
for dir in "$root"/plugins/c/*/; do
  name="c_$(basename "$dir" | tr '-' '_')"
  if stale "$out/$name.wasm" "$dir" "$root/wit"; then
    if ! c_tools_ready; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q $c_debian_packages >&2 \
          || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $c_debian_packages >&2; }
      else
        echo "building the C plugins needs Debian's $c_debian_packages (as root: apt-get install $c_debian_packages)" >&2
        exit 1
      fi
    fi
    install_once "$wit_bindgen" cargo_install wit-bindgen-cli 0.57.1 c
    install_once "$wasm_tools" cargo_install wasm-tools 1.262.0 component
    install_once "$c_adapter" adapter
    build="$root/plugins/target/c/$name"
    rm -rf "$build" && mkdir -p "$build"
    "$wit_bindgen/bin/wit-bindgen" c "$root/wit" --world plugin --out-dir "$build" >/dev/null
    clang-14 --target=wasm32-wasi -mexec-model=reactor -O2 -Wall -Werror -I"$build" \
      "$build/plugin.c" "$build/plugin_component_type.o" "$dir"/*.c -o "$build/core.wasm" >&2
    "$wasm_tools/bin/wasm-tools" component new "$build/core.wasm" \
      --adapt wasi_snapshot_preview1="$c_adapter/wasi_snapshot_preview1.reactor.wasm" -o "$out/$name.wasm.partial"
    mv "$out/$name.wasm.partial" "$out/$name.wasm"
  fi
done

echo "$out"
