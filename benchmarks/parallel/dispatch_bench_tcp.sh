#!/bin/bash
# dispatch_bench across two simulated hosts over TCP: one rank on each of two
# network namespaces joined by a bridge (veth links), mpirun in a third,
# Open MPI's TCP transport only (no shared memory), as between two nodes.
# The set-up is the multi-host tests' (tests/parallel/netns/netns_lib.sh);
# it needs root and `ip netns`, and is removed on exit.
#
# Usage: benchmarks/parallel/dispatch_bench_tcp.sh [BUILD_DIR] [dispatch_bench flags...]
#   e.g. benchmarks/parallel/dispatch_bench_tcp.sh build --tokens=2048 --reps=5
# With dispatch_bench's own defaults it takes about a minute; one compute
# thread per rank unless MOEFIT_NUM_THREADS says otherwise.
# LINK_RATE=1gbit (any tc rate) caps what each host sends (a token-bucket
# filter on its link), as a real network's wire does: veth links otherwise
# move bytes at memory speed, on the same cores that compute.
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source "$root/tests/parallel/netns/netns_lib.sh"

build=${1:-$root/build}
[ $# -gt 0 ] && shift
bench="$build/benchmarks/dispatch_bench"
[ -x "$bench" ] || { echo "dispatch_bench_tcp: no $bench (build the dispatch_bench target)" >&2; exit 2; }
flags=("$@")
if ! why=$(netns_check); then
  echo "dispatch_bench_tcp: cannot simulate hosts here: $why" >&2
  exit 2
fi

trap netns_teardown EXIT
trap 'exit 1' INT TERM
netns_setup "mfbench-$$" 2 || exit 1
hosts=$(mktemp)
trap 'rm -f "$hosts"; netns_teardown' EXIT
netns_hostfile "$hosts" 1 || exit 1
link=""
if [ -n "${LINK_RATE:-}" ]; then
  for ns in "${NETNS_HOSTS[@]}"; do
    tc -n "$ns" qdisc add dev eth0 root tbf rate "$LINK_RATE" burst 256kb latency 100ms || exit 1
  done
  link=", each host sending at most $LINK_RATE"
fi
threads=${MOEFIT_NUM_THREADS:-1}

echo "2 ranks on 2 simulated hosts (veth + bridge), Open MPI over TCP only$link ${flags[*]}"
before=$(netns_port_bytes 2)
start=$(date +%s)
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  timeout 600 "${NETNS_MPIRUN[@]}" -np 2 --hostfile "$hosts" \
  -x OMP_NUM_THREADS="$threads" -x MOEFIT_NUM_THREADS="$threads" "$bench" "${flags[@]}"
status=$?
after=$(netns_port_bytes 2)
echo "host 2's link carried $(( (after - before) / 1048576 )) MiB in $(( $(date +%s) - start )) s"
exit $status
