#!/bin/bash
# kill -9 of one rank during a training-checkpoint save, under mpirun -np 2:
# at each of three points of the save after step 4 (before any file, after
# the rank's first file, and on rank 0 after the manifest but before the
# rename) the job dies, the checkpoint of step 2 stays complete and is what
# "latest" resumes, and the resumed run's losses equal the uninterrupted run's
# bit for bit. The kill is injected with MOEFIT_CHECKPOINT_KILL=POINT:RANK:STEP
# (framework/training_checkpoint.cc), a hook for this test only.
# Usage: checkpoint_kill.sh MPIEXEC MOEFIT WORK_DIR
set -u
mpiexec=$1
moefit=$2
dir=$3
fail() { echo "FAIL: $*"; for f in "$dir"/*.log; do echo "== $f"; tail -5 "$f"; done; exit 1; }
rm -rf "$dir" && mkdir -p "$dir" || exit 1
run=("$mpiexec" -np 2 --oversubscribe -x OMP_NUM_THREADS=1 -x MOEFIT_NUM_THREADS=1)
common=(--set train.steps=8 --set train.seq_len=32 --set train.micro_batch_size=2
        --set model.hidden_size=64 --set model.head_dim=16 --set model.moe_intermediate_size=32
        --set model.num_hidden_layers=2 --set experts.num_threads=1 --set parallel.device=cpu)
extract() { grep -o '"step":[^,]*,\|"loss":[^,]*\|"aux_loss":[^,]*' "$1"; }

"${run[@]}" "$moefit" train "${common[@]}" --set logging.metrics_file="$dir/whole.jsonl" \
  > "$dir/whole.log" 2>&1 || fail "uninterrupted run failed"

for kill in before_files:1:4 after_first_file:1:4 before_publish:0:4; do
  point=${kill%%:*}
  ckpt=(--set checkpoint.save_dir="$dir/$point" --set checkpoint.save_every_steps=2)
  "${run[@]}" -x MOEFIT_CHECKPOINT_KILL="$kill" "$moefit" train "${common[@]}" "${ckpt[@]}" \
    --set logging.metrics_file= > "$dir/$point.log" 2>&1 && fail "$kill: the job was not killed"
  complete=$(ls "$dir/$point" | grep -v '^\.' | tr '\n' ' ')
  [ "$complete" = "step-00000002 " ] || fail "$kill: complete checkpoints: '$complete'"
  "${run[@]}" "$moefit" train "${common[@]}" "${ckpt[@]}" --set checkpoint.resume_from=latest \
    --set logging.metrics_file="$dir/$point.jsonl" > "$dir/$point-resume.log" 2>&1 \
    || fail "$kill: resume failed"
  grep -q "resumed from .*step-00000002 after step 2" "$dir/$point-resume.log" \
    || fail "$kill: did not resume from step 2"
  diff <(extract "$dir/whole.jsonl" | tail -n 18) <(extract "$dir/$point.jsonl") \
    || fail "$kill: resumed losses differ"
  [ -d "$dir/$point/step-00000008" ] || fail "$kill: no final checkpoint"
  leftovers=$(ls -A "$dir/$point" | grep '^\.' | tr '\n' ' ')
  [ -z "$leftovers" ] || fail "$kill: left behind: $leftovers"
  echo "ok: killed at $kill, resumed from step 2, steps 3-8 equal"
done
rm -rf "$dir"
