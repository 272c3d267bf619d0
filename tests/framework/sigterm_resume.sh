#!/bin/bash
# SIGTERM in the middle of `moefit train` with training checkpoints on: the
# run finishes its step, saves a checkpoint of it and exits 0; resuming from
# "latest" then gives every step's loss and balance loss exactly as the
# uninterrupted run (their metrics files compared line for line), and ends
# with the final checkpoint and the model in save_dir/final, which `moefit
# export` of that checkpoint reproduces file for file.
# Usage: sigterm_resume.sh MOEFIT WORK_DIR
set -u
moefit=$1
dir=$2
fail() { echo "FAIL: $*"; for f in "$dir"/*.log; do echo "== $f"; tail -5 "$f"; done; exit 1; }
rm -rf "$dir" && mkdir -p "$dir" || exit 1
common=(--set train.steps=30 --set train.seq_len=32 --set train.micro_batch_size=4
        --set model.hidden_size=64 --set model.head_dim=16 --set model.moe_intermediate_size=32
        --set model.num_hidden_layers=2 --set experts.num_threads=1 --set parallel.device=cpu)
ckpt=(--set checkpoint.save_dir="$dir/ckpt" --set checkpoint.save_every_steps=1000)

"$moefit" train "${common[@]}" --set logging.metrics_file="$dir/whole.jsonl" \
  > "$dir/whole.log" 2>&1 || fail "uninterrupted run failed"

# A 100 ms sleep at the start of every step of this run (the test-only fault
# hook; the numbers do not change), so that the signal lands mid-run however
# fast the machine.
MOEFIT_FAULT=slow:rank=0:ms=100 "$moefit" train "${common[@]}" "${ckpt[@]}" \
  --set logging.metrics_file="$dir/cut.jsonl" > "$dir/cut.log" 2>&1 &
pid=$!
for _ in $(seq 1 1200); do
  grep -q "^step 5/30" "$dir/cut.log" && break
  sleep 0.05
done
kill -TERM "$pid"
wait "$pid"
rc=$?
[ "$rc" = 0 ] || fail "exit code $rc after SIGTERM, expected 0"
grep -q "stopped by a signal after step" "$dir/cut.log" || fail "no stop message"
saved=$(ls "$dir/ckpt")
[ "$(echo "$saved" | wc -l)" = 1 ] || fail "expected one checkpoint, found: $saved"
case "$saved" in step-000000[0-2][0-9]) ;; *) fail "unexpected checkpoint $saved" ;; esac
[ "$saved" != step-00000030 ] || fail "the run was not interrupted"
echo "stopped at $saved"

"$moefit" train "${common[@]}" "${ckpt[@]}" --set logging.metrics_file="$dir/cut.jsonl" \
  --set checkpoint.resume_from=latest > "$dir/resume.log" 2>&1 || fail "resume failed"
grep -q "resumed from .*$saved" "$dir/resume.log" || fail "did not resume from $saved"
[ -d "$dir/ckpt/step-00000030" ] || fail "no final checkpoint"
[ -f "$dir/ckpt/final/config.json" ] || fail "no final model in save_dir/final"

"$moefit" inspect "$dir/ckpt/step-00000030" > "$dir/inspect.log" 2>&1 || fail "inspect failed"
grep -q "training checkpoint after step 30 (mode full), saved by 1 processes" "$dir/inspect.log" \
  || fail "inspect does not describe the checkpoint"

# The last checkpoint exported is the final model, file for file.
"$moefit" export "$dir/ckpt/step-00000030" "$dir/exported" > "$dir/export.log" 2>&1 \
  || fail "export failed"
for f in "$dir/ckpt/final"/*; do
  cmp "$f" "$dir/exported/$(basename "$f")" || fail "exported $(basename "$f") differs"
done

extract() { grep -o '"step":[^,]*,\|"loss":[^,]*\|"aux_loss":[^,]*' "$1"; }
[ "$(grep -c . "$dir/whole.jsonl")" = 30 ] || fail "uninterrupted metrics incomplete"
[ "$(grep -c . "$dir/cut.jsonl")" = 30 ] || fail "interrupted + resumed metrics: not 30 steps"
diff <(extract "$dir/whole.jsonl") <(extract "$dir/cut.jsonl") || fail "losses differ"
echo "ok: 30 steps, losses equal"
rm -rf "$dir"
