#!/bin/bash
# The bytes per training step that cross between ranks, with deduplicated
# dispatch and one row per (token, slot), at top-8 over 4 and 8 ranks, for
# uniform routing and for the routing of a trained model: trains the demo
# model with 64 experts, top-8 (one process, STEPS steps, default 300; a
# training checkpoint at the end, kept in WORK_DIR and reused), then runs
# dispatch_bytes on it under mpirun -np 4 and -np 8. The numbers are counted,
# not timed: oversubscribed cores change nothing.
#
# Usage: benchmarks/parallel/dispatch_bytes.sh [BUILD_DIR] [WORK_DIR]
# (targets moefit and dispatch_bytes; WORK_DIR defaults to BUILD_DIR/dispatch_bytes)
set -eu
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build}
work=${2:-$build/dispatch_bytes}
steps=${STEPS:-300}
for exe in launch/moefit benchmarks/dispatch_bytes; do
  [ -x "$build/$exe" ] || { echo "dispatch_bytes.sh: no $build/$exe" >&2; exit 2; }
done
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
ckpt="$work/ckpt/step-$(printf %08d "$steps")"
if [ ! -d "$ckpt" ]; then
  echo "training the demo model, 64 experts top-8, for $steps steps into $work/ckpt"
  mkdir -p "$work"
  "$build/launch/moefit" train --set model.num_experts=64 --set model.num_experts_per_tok=8 \
    --set train.steps="$steps" --set checkpoint.save_dir="$work/ckpt" \
    --set checkpoint.save_every_steps="$steps" --set logging.metrics_file="$work/train.jsonl" \
    >"$work/train.log" 2>&1 || { tail -5 "$work/train.log"; exit 1; }
  grep '^moefit: done\|^done' "$work/train.log" || tail -2 "$work/train.log"
fi
for np in 4 8; do
  mpirun -np "$np" --oversubscribe -x OMP_NUM_THREADS=1 -x MOEFIT_NUM_THREADS=1 \
    "$build/benchmarks/dispatch_bytes" --checkpoint="$ckpt"
  echo
done
