#!/usr/bin/env bash
# Installs what is missing, builds, and runs the demo training: a tiny
# Qwen3-MoE-shaped model learning the English corpus shipped with moefit.
# Extra arguments go to `moefit train` (e.g. --set train.steps=50).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${MOEFIT_BUILD_DIR:-$root/build}
"$here/setup.sh"
exec "$build/launch/moefit" train --set logging.metrics_file="$build/demo-metrics.jsonl" "$@"
