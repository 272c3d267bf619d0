#!/usr/bin/env bash
# Installs what is missing, builds, and runs the demo training: a tiny
# Qwen3-MoE-shaped model learning the English corpus shipped with moefit, with
# its experts spread over MOEFIT_NP processes (default 2) by mpirun.
# Extra arguments go to `moefit train` (e.g. --set train.steps=50).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${MOEFIT_BUILD_DIR:-$root/build}
np=${MOEFIT_NP:-2}
"$here/setup.sh"

# Open MPI refuses root unless told; one compute thread per process unless the
# machine has cores to spare.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MOEFIT_NUM_THREADS=${MOEFIT_NUM_THREADS:-$(( $(nproc) / np > 0 ? $(nproc) / np : 1 ))}
# The demo's global batch is 16 sequences: split it over the processes.
exec mpirun -np "$np" --oversubscribe "$build/launch/moefit" train \
  --set train.micro_batch_size=$(( 16 / np > 0 ? 16 / np : 1 )) \
  --set logging.metrics_file="$build/demo-metrics.jsonl" "$@"
