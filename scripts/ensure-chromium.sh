#!/usr/bin/env bash
# Installs Debian's chromium and chromium-driver (as root, with apt-get) for the dashboard's
# browser test, unless they are there. Idempotent. Prints the chromedriver's path.
set -euo pipefail
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver >&2; }
    install || { apt-get update -q >&2 && install; }
  else
    echo "the dashboard's browser test needs Debian's chromium and chromium-driver (as root: apt-get install chromium chromium-driver)" >&2
    exit 1
  fi
fi
command -v chromedriver
