#!/bin/bash
# SIGTERM to one process of a 2-process `moefit train` (under mpirun): both
# ranks finish the step, agree to stop (an all-reduce of the stop flag after
# every step), save a checkpoint of it, and the job exits 0; resuming from
# "latest" at 2 processes then gives every step's loss exactly as the
# uninterrupted 2-process run.
# Usage: sigterm_mpi.sh MPIEXEC MOEFIT WORK_DIR
set -u
mpiexec=$1
moefit=$2
dir=$3
fail() { echo "FAIL: $*"; for f in "$dir"/*.log; do echo "== $f"; tail -5 "$f"; done; exit 1; }
rm -rf "$dir" && mkdir -p "$dir" || exit 1
run=("$mpiexec" -np 2 --oversubscribe -x OMP_NUM_THREADS=1 -x MOEFIT_NUM_THREADS=1)
common=(--set train.steps=40 --set train.seq_len=32 --set train.micro_batch_size=2
        --set model.hidden_size=64 --set model.head_dim=16 --set model.moe_intermediate_size=32
        --set model.num_hidden_layers=2 --set experts.num_threads=1 --set parallel.device=cpu)
ckpt=(--set checkpoint.save_dir="$dir/ckpt" --set checkpoint.save_every_steps=1000)
extract() { grep -o '"step":[^,]*,\|"loss":[^,]*\|"aux_loss":[^,]*' "$1"; }

"${run[@]}" "$moefit" train "${common[@]}" --set logging.metrics_file="$dir/whole.jsonl" \
  > "$dir/whole.log" 2>&1 || fail "uninterrupted run failed"

# Rank 0 sleeps 100 ms at the start of every step of this run (the test-only
# fault hook; the numbers do not change), so that the signal lands mid-run
# however fast the machine: unslowed, 40 steps can end before step 5 is seen.
"${run[@]}" -x MOEFIT_FAULT=slow:rank=0:ms=100 "$moefit" train "${common[@]}" "${ckpt[@]}" \
  --set logging.metrics_file="$dir/cut.jsonl" > "$dir/cut.log" 2>&1 &
mpirun_pid=$!
for _ in $(seq 1 1200); do
  grep -q "^step 5/40" "$dir/cut.log" && break
  sleep 0.05
done
# The ranks are mpirun's children; signal one of them only.
rank_pid=$(ps -o pid= --ppid "$mpirun_pid" | sort -n | tail -n 1 | tr -d ' ')
[ -n "$rank_pid" ] || fail "no rank process found"
kill -TERM "$rank_pid"
wait "$mpirun_pid"
rc=$?
[ "$rc" = 0 ] || fail "exit code $rc after SIGTERM to one rank, expected 0"
grep -q "stopped by a signal after step" "$dir/cut.log" || fail "no stop message"
saved=$(ls "$dir/ckpt")
[ "$(echo "$saved" | wc -l)" = 1 ] || fail "expected one checkpoint, found: $saved"
[ "$saved" != step-00000040 ] || fail "the run was not interrupted"
echo "stopped at $saved"

"${run[@]}" "$moefit" train "${common[@]}" "${ckpt[@]}" --set logging.metrics_file="$dir/cut.jsonl" \
  --set checkpoint.resume_from=latest > "$dir/resume.log" 2>&1 || fail "resume failed"
[ "$(grep -c . "$dir/cut.jsonl")" = 40 ] || fail "interrupted + resumed metrics: not 40 steps"
diff <(extract "$dir/whole.jsonl") <(extract "$dir/cut.jsonl") || fail "losses differ"
echo "ok: 40 steps at 2 processes, losses equal"
rm -rf "$dir"
