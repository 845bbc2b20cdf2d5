#!/usr/bin/env bash
# Installs the Python packages the examples and tests use (pymongo; prometheus-client, whose
# parser reads the host's /metrics in the tests) into a cache outside the repository, pinned.
# Idempotent. Prints the directory to put on PYTHONPATH.
set -euo pipefail
source "$(dirname "$0")/cache.sh"
dir="$cache/python-pymongo-4.20.0-prometheus-client-0.21.1"
install_once "$dir" pip_install "pymongo==4.20.0" "dnspython==2.9.2" "prometheus-client==0.21.1"
echo "$dir"
