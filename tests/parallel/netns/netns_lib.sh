# Simulated hosts on one machine: Linux network namespaces joined by a bridge.
#
# Sourced by the multi-host tests (tests/parallel/netns/) and the dispatch
# benchmark over TCP (benchmarks/parallel/dispatch_bench_tcp.sh). A set is
#   <prefix>-sw     the "switch": a bridge (br0) and one veth port per host;
#   <prefix>-mpi    where mpirun runs (the login node), 10.77.0.1;
#   <prefix>-h<k>   host k (k = 1..N), 10.77.0.(10+k), its own hostname;
# each joined to the bridge by a veth pair (eth0 in the host, p<k> in the
# switch; the launcher's port is p0). Every address, route and link lives
# inside the set's own namespaces, so sets made by tests running at the same
# time never see each other: only the prefix (namespace names) must differ.
#
# mpirun reaches the hosts through an rsh agent (netns_agent.sh) that runs
# the daemon's command inside the namespace named like the host, and talks
# TCP only (NETNS_MPI_ARGS): no shared memory, no other transport, so every
# byte between ranks crosses the veth links and a link taken down stops it.
#
# Functions (non-zero status on failure, with the failing command's message):
#   netns_check                 prints why namespaces cannot be made here and
#                               returns non-zero, if so
#   netns_setup PREFIX N        make the set with N hosts; NETNS_HOSTS = names
#   netns_teardown              kill what runs in the set, delete it (idempotent)
#   netns_hostfile FILE SLOTS   a hostfile naming the N hosts
#   netns_mpirun ARGS...        mpirun inside the launcher namespace (the
#                               same command as an array: NETNS_MPIRUN)
#   netns_cut K                 take host K's switch port down
#   netns_port_bytes K          bytes host K's switch port carried
#   netns_pids                  pids of processes in any namespace of the set

NETNS_SUBNET=10.77.0.0/24
NETNS_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NETNS_PREFIX=
NETNS_HOSTS=()
NETNS_MPIRUN=()

# TCP between the namespaces only; the agent starts each host's daemon; no
# tree spawn (the daemons would start each other through the agent).
NETNS_MPI_ARGS=(--mca plm_rsh_agent "$NETNS_LIB_DIR/netns_agent.sh"
                --mca plm_rsh_no_tree_spawn 1
                --mca pml ob1 --mca btl tcp,self
                --mca btl_tcp_if_include "$NETNS_SUBNET"
                --mca oob_tcp_if_include "$NETNS_SUBNET")

netns_check() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "needs root to make network namespaces (running as uid $(id -u))"
    return 1
  fi
  local tool
  for tool in ip unshare mpirun; do
    command -v "$tool" >/dev/null || { echo "'$tool' is not installed"; return 1; }
  done
  local probe="mfprobe-$$-$RANDOM" out
  if ! out=$(ip netns add "$probe" 2>&1); then
    echo "'ip netns add' fails here: $out"
    return 1
  fi
  if ! out=$(ip -n "$probe" link add vprobe0 type veth peer name vprobe1 2>&1); then
    ip netns delete "$probe" 2>/dev/null
    echo "cannot make veth pairs here: $out"
    return 1
  fi
  if ! out=$(ip -n "$probe" link add bprobe0 type bridge 2>&1); then
    ip netns delete "$probe" 2>/dev/null
    echo "cannot make bridges here: $out"
    return 1
  fi
  ip netns delete "$probe"
  return 0
}

netns_setup() {
  local prefix=$1 num_hosts=$2 k
  NETNS_PREFIX=$prefix
  NETNS_HOSTS=()
  local sw="$prefix-sw"
  # A set left by a killed run of the same process id is stale: remove it.
  netns_teardown
  NETNS_PREFIX=$prefix
  NETNS_MPIRUN=(ip netns exec "$prefix-mpi" mpirun "${NETNS_MPI_ARGS[@]}")
  ip netns add "$sw" || return 1
  ip -n "$sw" link set lo up || return 1
  ip -n "$sw" link add br0 type bridge || return 1
  ip -n "$sw" link set br0 up || return 1
  # Port 0: the launcher; ports 1..N: the hosts.
  local names=("$prefix-mpi") addrs=(10.77.0.1)
  for k in $(seq 1 "$num_hosts"); do
    names+=("$prefix-h$k")
    addrs+=("10.77.0.$((10 + k))")
    NETNS_HOSTS+=("$prefix-h$k")
  done
  for k in "${!names[@]}"; do
    local ns=${names[$k]}
    ip netns add "$ns" || return 1
    ip -n "$ns" link set lo up || return 1
    ip -n "$ns" link add eth0 type veth peer name "p$k" netns "$sw" || return 1
    ip -n "$ns" addr add "${addrs[$k]}/24" dev eth0 || return 1
    ip -n "$ns" link set eth0 up || return 1
    ip -n "$sw" link set "p$k" master br0 || return 1
    ip -n "$sw" link set "p$k" up || return 1
  done
}

netns_pids() {
  [ -n "$NETNS_PREFIX" ] || return 0
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$NETNS_PREFIX-"); do
    ip netns pids "$ns" 2>/dev/null
  done
}

netns_teardown() {
  [ -n "$NETNS_PREFIX" ] || return 0
  local pids
  pids=$(netns_pids)
  if [ -n "$pids" ]; then
    kill -9 $pids 2>/dev/null
    sleep 0.2
  fi
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$NETNS_PREFIX-"); do
    ip netns delete "$ns" 2>/dev/null
  done
  NETNS_PREFIX=
}

netns_hostfile() {
  local file=$1 slots=$2 host
  : >"$file" || return 1
  for host in "${NETNS_HOSTS[@]}"; do
    echo "$host slots=$slots" >>"$file"
  done
}

netns_mpirun() {
  "${NETNS_MPIRUN[@]}" "$@"
}

# Bytes that host K's switch port carried, both ways.
netns_port_bytes() {
  ip netns exec "$NETNS_PREFIX-sw" \
    sh -c "echo \$((\$(cat /sys/class/net/p$1/statistics/rx_bytes) + \$(cat /sys/class/net/p$1/statistics/tx_bytes)))"
}

netns_cut() {
  ip -n "$NETNS_PREFIX-sw" link set "p$1" down
}
