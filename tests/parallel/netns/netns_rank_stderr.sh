#!/bin/sh
# Runs COMMAND as an MPI rank with its stderr in DIR/rank<r>.err, after
# writing the name of the host it runs on to DIR/rank<r>.host.
# Usage (as mpirun's program): netns_rank_stderr.sh DIR COMMAND...
# exec keeps the rank's process: its daemon's signals reach it directly.
dir=$1
shift
rank=${OMPI_COMM_WORLD_RANK:?not started by mpirun}
hostname >"$dir/rank$rank.host"
exec "$@" 2>"$dir/rank$rank.err"
