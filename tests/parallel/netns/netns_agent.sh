#!/bin/bash
# The rsh agent of the simulated hosts (netns_lib.sh): mpirun calls it as
#   netns_agent.sh HOST COMMAND...
# like ssh, and it runs COMMAND with sh inside the network namespace named
# HOST, under its own hostname (a UTS namespace), as a remote shell would.
set -u
host=$1
shift
[ -e "/var/run/netns/$host" ] || { echo "netns_agent: no network namespace '$host'" >&2; exit 255; }
exec ip netns exec "$host" unshare --uts sh -c "hostname '$host' && $*"
