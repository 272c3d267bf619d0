#!/bin/bash
# Expert parallelism across simulated hosts (netns_lib.sh: network
# namespaces on a bridge, mpirun in a third one, ranks started through an rsh
# agent, TCP only), one rank per host, `moefit train` on a small model.
#
# Usage: multihost_test.sh MODE MOEFIT WORK_DIR
#   equal     the losses (every step, 1e-5 relative) and `moefit eval` equal one
#             process over the same global batch;
#   equal3    the same with three hosts (8 experts: 3, 3 and 2 per rank);
#   cut       host 2's switch port goes down once 3 steps are done: every
#             rank on both hosts ends within parallel.timeout_s + 15 s of the
#             cut, each having reported the collective that missed its deadline
#             (exit code 124), the one on the cut-off host included, which
#             cannot reach mpirun;
#   kill      mpirun is killed (SIGKILL) once 3 steps are done: every rank ends
#             within the bound (each host's daemon loses mpirun and ends its
#             ranks);
#   cut_kill  host 2's port goes down, then mpirun is killed: host 2 hears of
#             neither, and its rank must end by its own deadline;
#   cut_stop  host 2's port goes down and its daemon stops (SIGSTOP): the
#             rank's request to end the job is never answered, and it must
#             end by itself (exit code 124) within the bound;
#   cut_save  host 2's port goes down while the training checkpoint of step 4
#             is being saved (rank 1 holds the save open after its first file,
#             MOEFIT_FAULT=...:at=save): the save is never published; every
#             rank ends within parallel.startup_timeout_s (the deadline
#             outside steps) + 15 s, each naming the collective of the save it
#             waited for; the checkpoint of step 2 stays the only complete
#             one, and a run resumed from it on the hosts (the link back up)
#             gives the uninterrupted run's losses bit for bit.
# Exits 77 (ctest's SKIP_RETURN_CODE) with the reason where network
# namespaces cannot be made (not root, no `ip netns`, no veth).
set -u
usage="usage: $0 equal|equal3|cut|kill|cut_kill|cut_stop|cut_save MOEFIT WORK_DIR"
[ $# -eq 3 ] || { echo "$usage" >&2; exit 2; }
mode=$1
moefit=$2
dir=$3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/netns_lib.sh"

timeout_s=5
bound_s=$((timeout_s + 15))
steps=400  # far more than the cases that fail on purpose get through

case "$mode" in
  equal | equal3 | cut | kill | cut_kill | cut_stop | cut_save) ;;
  *) echo "$usage (got mode '$mode')" >&2; exit 2 ;;
esac
if ! why=$(netns_check); then
  echo "SKIP: simulated hosts are not possible here: $why"
  exit 77
fi

fail() {
  echo "FAIL: $*"
  local f
  for f in "$dir"/*.log "$dir"/*.err; do
    [ -f "$f" ] && { echo "== $f"; tail -n 8 "$f"; }
  done
  exit 1
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

trap netns_teardown EXIT
trap 'exit 1' INT TERM
rm -rf "$dir" && mkdir -p "$dir" || exit 1
num_hosts=2
[ "$mode" = equal3 ] && num_hosts=3
netns_setup "mfnet-$$" $num_hosts || fail "could not make the simulated hosts"
netns_hostfile "$dir/hosts" 1 || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

model=(--set train.seq_len=32 --set model.hidden_size=64 --set model.head_dim=16
       --set model.moe_intermediate_size=32 --set model.num_hidden_layers=2
       --set experts.num_threads=1 --set parallel.device=cpu)
threads=(-x OMP_NUM_THREADS=1 -x MOEFIT_NUM_THREADS=1)
# Each rank's stderr goes to its own file (rank<r>.err): what a rank cut off
# from mpirun prints never reaches mpirun's output.
on_hosts=("${NETNS_MPIRUN[@]}" -np $num_hosts --hostfile "$dir/hosts" "${threads[@]}"
          "$here/netns_rank_stderr.sh" "$dir")

losses() { grep -o '"loss":[^,]*\|"grad_norm":[^,]*' "$1" | cut -d: -f2; }

if [ "$mode" = equal ] || [ "$mode" = equal3 ]; then
  # The same global batch: 2 sequences per rank, or all in one process.
  train=(train "${model[@]}" --set train.steps=6)
  OMP_NUM_THREADS=1 MOEFIT_NUM_THREADS=1 timeout 60 "$moefit" "${train[@]}" \
    --set train.micro_batch_size=$((2 * num_hosts)) --set logging.metrics_file="$dir/one.jsonl" \
    >"$dir/one.log" 2>&1 || fail "1 process: training failed"
  timeout 60 "${on_hosts[@]}" "$moefit" "${train[@]}" --set train.micro_batch_size=2 \
    --set logging.metrics_file="$dir/hosts.jsonl" >"$dir/hosts.log" 2>&1 \
    || fail "$num_hosts hosts: training failed"
  [ "$(losses "$dir/one.jsonl" | wc -l)" = 12 ] || fail "1 process: not 6 steps of metrics"
  paste <(losses "$dir/one.jsonl") <(losses "$dir/hosts.jsonl") | awk '
    { d = $1 - $2; if (d < 0) d = -d; r = d / ($1 < 0 ? -$1 : $1); if (r > worst) worst = r }
    NF != 2 { bad = 1 }
    END { printf "largest relative difference of loss and grad_norm over 6 steps: %.2g\n", worst
          exit (bad || worst > 1e-5) }' || fail "losses differ between 1 process and $num_hosts hosts"
  evaluate=(eval "${model[@]}" --eval_sequences 8)
  one=$(OMP_NUM_THREADS=1 MOEFIT_NUM_THREADS=1 timeout 60 "$moefit" "${evaluate[@]}" 2>&1 \
        | grep '^eval:') || fail "1 process: eval failed"
  many=$(timeout 60 "${on_hosts[@]}" "$moefit" "${evaluate[@]}" 2>&1 | grep '^eval:') \
    || fail "$num_hosts hosts: eval failed"
  echo "1 process: $one"
  echo "$num_hosts hosts:   $many"
  [ "$one" = "$many" ] || fail "eval differs between 1 process and $num_hosts hosts"
  for r in $(seq 0 $((num_hosts - 1))); do
    [ "$(cat "$dir/rank$r.host")" = "${NETNS_HOSTS[$r]}" ] \
      || fail "rank $r ran on '$(cat "$dir/rank$r.host")', not on ${NETNS_HOSTS[$r]}"
  done
  # Every host took part over its link: the token exchange of 6 steps and 8
  # sequences alone is several hundred KiB.
  for k in $(seq 1 $num_hosts); do
    bytes=$(netns_port_bytes $k)
    echo "host $k's link carried $bytes bytes"
    [ "$bytes" -gt 500000 ] || fail "host $k's link carried only $bytes bytes"
  done
  echo "ok: $num_hosts ranks on $num_hosts simulated hosts over TCP equal 1 process"
  rm -rf "$dir"
  exit 0
fi

# The ranks, by host.
# (A rank that has exited but is not yet reaped, a zombie, has ended.)
ranks_in() { local p; for p in $(ip netns pids "$1" 2>/dev/null); do
  [ "$(ps -o comm=,stat= -p "$p" 2>/dev/null | awk '$2 !~ /^Z/ { print $1 }')" = moefit ] \
    && echo "$p"; done; }
# Waits until no moefit rank runs on either host; prints the seconds since $1.
wait_ranks_gone() {
  while [ "$(elapsed "$1" "$(now)" | cut -d. -f1)" -lt "$2" ]; do
    if [ -z "$(ranks_in "${NETNS_HOSTS[0]}")$(ranks_in "${NETNS_HOSTS[1]}")" ]; then
      elapsed "$1" "$(now)"
      return 0
    fi
    sleep 0.2
  done
  return 1
}

if [ "$mode" = cut_save ]; then
  save_timeout_s=10
  save_bound_s=$((save_timeout_s + 15))
  hold_ms=3000  # rank 1 inside the save: well within the save's deadline
  train=(train "${model[@]}" --set train.steps=6 --set train.micro_batch_size=2
         --set parallel.timeout_s=$timeout_s --set parallel.startup_timeout_s=$save_timeout_s)
  ckpt=(--set checkpoint.save_dir="$dir/ckpt" --set checkpoint.save_every_steps=2)
  timeout 90 "${on_hosts[@]}" "$moefit" "${train[@]}" --set logging.metrics_file="$dir/whole.jsonl" \
    >"$dir/whole.log" 2>&1 || fail "the uninterrupted run failed"
  held="MOEFIT_FAULT: rank 1 sleeps $hold_ms ms at step 4 in the checkpoint save"
  "${NETNS_MPIRUN[@]}" -np 2 --hostfile "$dir/hosts" "${threads[@]}" \
    -x MOEFIT_FAULT="slow:rank=1:ms=$hold_ms:step=4:at=save" "$here/netns_rank_stderr.sh" "$dir" \
    "$moefit" "${train[@]}" "${ckpt[@]}" --set logging.metrics_file="$dir/cut.jsonl" \
    >"$dir/run.log" 2>&1 &
  disown
  for _ in $(seq 1 900); do
    grep -q "$held" "$dir/rank1.err" 2>/dev/null && break
    sleep 0.1
  done
  grep -q "$held" "$dir/rank1.err" 2>/dev/null || fail "rank 1 did not reach the save of step 4"
  t_cut=$(now)
  netns_cut 2
  echo "cut while rank 1 is in the save of step 4 ($(ls -A "$dir/ckpt" | tr '\n' ' '))"
  gone=$(wait_ranks_gone "$t_cut" $((save_bound_s + 10))) \
    || fail "ranks still running $((save_bound_s + 10)) s after the cut"
  echo "every rank on both hosts ended ${gone} s after the cut (bound:" \
    "parallel.startup_timeout_s $save_timeout_s + 15 = $save_bound_s s)"
  awk -v t="$gone" -v b="$save_bound_s" 'BEGIN { exit !(t <= b) }' \
    || fail "the ranks took ${gone} s, more than $save_bound_s s"
  for r in 0 1; do
    line=$(grep -m1 "moefit: rank $r of 2 aborting the job" "$dir/rank$r.err")
    echo "rank $r: ${line:-(no abort line)}" | cut -c1-400
    grep -q "rank $r of 2 aborting the job (exit code 124): collective watchdog: .* did not finish within ${save_timeout_s}s (parallel.startup_timeout_s); outside training steps (last step begun: 4), saving a training checkpoint; last completed collective: " \
      "$dir/rank$r.err" || fail "rank $r did not report the save's collective and its deadline"
  done
  complete=$(ls "$dir/ckpt" | tr '\n' ' ')
  [ "$complete" = "step-00000002 " ] || fail "complete checkpoints after the cut: '$complete'"
  # The save of step 4 began (every rank wrote files) but was never published.
  unfinished="$dir/ckpt/.step-00000004.partial"
  [ -d "$unfinished" ] || fail "no unfinished save of step 4"
  [ ! -e "$unfinished/manifest.binpb" ] || fail "the save of step 4 got as far as its manifest"
  echo "after the cut: complete step-00000002; unfinished, without a manifest:" \
    "$(ls "$unfinished" | tr '\n' ' ')"
  # The hosts again, the link up (mpirun still waits for host 2's daemon).
  netns_setup "mfnet-$$" 2 || fail "could not make the simulated hosts again"
  timeout 90 "${on_hosts[@]}" "$moefit" "${train[@]}" "${ckpt[@]}" \
    --set checkpoint.resume_from=latest --set logging.metrics_file="$dir/resumed.jsonl" \
    >"$dir/resumed.log" 2>&1 || fail "the resumed run failed"
  grep -q "resumed from .*step-00000002 after step 2" "$dir/resumed.log" \
    || fail "did not resume from the checkpoint of step 2"
  per_step() { grep -o '"step":[^,]*,\|"loss":[^,]*\|"grad_norm":[^,]*' "$1"; }
  [ "$(per_step "$dir/resumed.jsonl" | wc -l)" = 12 ] || fail "the resumed run did not log steps 3-6"
  diff <(per_step "$dir/whole.jsonl" | tail -n 12) <(per_step "$dir/resumed.jsonl") \
    || fail "the resumed run's losses differ from the uninterrupted run's"
  [ -d "$dir/ckpt/step-00000006" ] || fail "no checkpoint of step 6 after the resumed run"
  leftovers=$(ls -A "$dir/ckpt" | grep '^\.' | tr '\n' ' ')
  [ -z "$leftovers" ] || fail "left behind after the resumed run's saves: $leftovers"
  echo "ok: cut during the save of step 4: step 2 stayed complete; resumed on the hosts, steps 3-6" \
    "equal the uninterrupted run's bit for bit"
  rm -rf "$dir"
  exit 0
fi

# --- the failure modes -------------------------------------------------------
# With training checkpoints, as long runs have: after every step the ranks
# agree on whether to stop or save (no save falls due here). Not when mpirun
# is killed: its daemons' SIGTERM would then rightly stop the ranks with a
# checkpoint and exit 0.
ckpt=()
[ "$mode" = kill ] || ckpt=(--set checkpoint.save_dir="$dir/ckpt" --set checkpoint.save_every_steps=100000)
"${on_hosts[@]}" "$moefit" train "${model[@]}" --set train.steps=$steps "${ckpt[@]}" \
  --set train.micro_batch_size=2 --set parallel.timeout_s=$timeout_s \
  --set logging.metrics_file="$dir/run.jsonl" >"$dir/run.log" 2>&1 &
disown  # ended by the test or its clean-up, not waited for
for _ in $(seq 1 600); do
  [ "$(grep -c . "$dir/run.jsonl" 2>/dev/null)" -ge 3 ] 2>/dev/null && break
  sleep 0.1
done
[ "$(grep -c . "$dir/run.jsonl" 2>/dev/null)" -ge 3 ] 2>/dev/null || fail "no 3 steps within 60 s"

ranks1=$(ranks_in "${NETNS_HOSTS[0]}")
ranks2=$(ranks_in "${NETNS_HOSTS[1]}")
[ -n "$ranks1" ] && [ -n "$ranks2" ] || fail "expected a moefit rank on each host"
launcher=$(ip netns pids "$NETNS_PREFIX-mpi")

t_cut=$(now)
case "$mode" in
  cut) netns_cut 2 ;;
  kill) kill -KILL $launcher ;;
  cut_kill) netns_cut 2 && kill -KILL $launcher ;;
  cut_stop) netns_cut 2 && kill -STOP $(ip netns pids "${NETNS_HOSTS[1]}" | grep -vxF "$ranks2") ;;
esac
echo "$mode after step $(grep -c . "$dir/run.jsonl") of $steps"

gone=$(wait_ranks_gone "$t_cut" $((bound_s + 10))) || fail "ranks still running $((bound_s + 10)) s after the $mode:" \
  "$(netns_pids | xargs -r ps -o pid=,comm= -p | tr '\n' ' ')"
echo "every rank on both hosts ended ${gone} s after the $mode (bound: parallel.timeout_s" \
  "$timeout_s + 15 = $bound_s s)"
awk -v t="$gone" -v b="$bound_s" 'BEGIN { exit !(t <= b) }' \
  || fail "the ranks took ${gone} s, more than $bound_s s"
[ "$(grep -c . "$dir/run.jsonl")" -lt $steps ] || fail "training completed: nothing was cut"

# How each rank ended: a rank that reached a deadline says so in its stderr
# (and exits 124); a rank its daemon ended has no line (killed by a signal).
for r in 0 1; do
  line=$(grep -m1 "moefit: rank $r of 2 aborting the job" "$dir/rank$r.err")
  [ -n "$line" ] || line="(no abort line: ended by the daemon of its host)"
  echo "rank $r: $line" | cut -c1-300
done
if [ "$mode" != kill ]; then
  # The rank on the cut-off host hears from no one: only its own deadline ends it.
  grep -q "rank 1 of 2 aborting the job (exit code 124): collective watchdog: .* did not finish within 5s (parallel.timeout_s); in training step" \
    "$dir/rank1.err" || fail "rank 1 (cut-off host) did not report its collective's deadline"
fi
if [ "$mode" = cut_stop ]; then
  # Its daemon is stopped and cannot reap it: the exit status is still in
  # /proc (field 52 of stat, as waitpid reports it).
  status=$(sed 's/.*) //' "/proc/$ranks2/stat" 2>/dev/null | awk '{ print $50 }')
  echo "rank 1 (cut-off host, daemon stopped) exit status: $((${status:-0} >> 8))"
  [ "$status" = $((124 << 8)) ] || fail "rank 1 exit status '$status', expected 124 << 8"
fi
if [ "$mode" = cut ]; then
  grep -q "rank 0 of 2 aborting the job (exit code 124): collective watchdog:" "$dir/rank0.err" \
    || fail "rank 0 did not report its collective's deadline"
fi

# mpirun (when alive) waits for the unreachable host's daemon until TCP gives
# up on it; the ranks are what must not outlive the job, so only report it.
if [ "$mode" = cut ]; then
  if kill -0 $launcher 2>/dev/null; then
    echo "note: mpirun still waits for host 2's daemon $(elapsed "$t_cut" "$(now)") s after the cut"
  else
    echo "mpirun ended too"
  fi
fi
echo "ok: $mode: every rank ended within the bound, before training was done"
rm -rf "$dir"
exit 0
