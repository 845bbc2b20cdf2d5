# Sourced by the set-up scripts: the cache outside the repository and the one way to fill it.
cache="${RELAYHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/relayhost}"

# install_once DIR FUNCTION [ARGS...]: unless DIR is complete, runs FUNCTION with an empty
# scratch directory as its first argument (then ARGS), and moves the result to DIR. An
# interrupted install leaves only the scratch directory, which the next run starts over.
install_once() {
  local dir="$1" install="$2"
  shift 2
  [ -f "$dir/.complete" ] && return 0
  rm -rf "$dir.partial" && mkdir -p "$dir.partial"
  "$install" "$dir.partial" "$@" >&2
  touch "$dir.partial/.complete"
  rm -rf "$dir" && mv "$dir.partial" "$dir"
}

# pip_install TARGET REQUIREMENT...: binary wheels only, into TARGET.
pip_install() {
  local target="$1"
  shift
  python3 -m pip install --quiet --disable-pip-version-check --only-binary=:all: --target "$target" "$@"
}

# npm_ci TARGET PACKAGE_DIR: the exact tree of PACKAGE_DIR's package-lock.json, into TARGET.
npm_ci() {
  cp "$2/package.json" "$2/package-lock.json" "$1/"
  (cd "$1" && npm ci --silent --no-audit --no-fund)
}
