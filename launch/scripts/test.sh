#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite: every ctest
# test (unit, model, cli, mpi, netns, sanitizer labels) and the interop tests against
# the real Python clients (tests/interop, pytest).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${MOEFIT_BUILD_DIR:-$root/build}
venv=${MOEFIT_VENV:-$HOME/.cache/moefit/venv}
"$here/setup.sh"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0
(cd "$build" && ctest --output-on-failure -j "${MOEFIT_TEST_JOBS:-2}") || status=1

# pytest exits 5 when it collects nothing: that is a failure of the suite here.
MOEFIT_BUILD_DIR="$build" "$venv/bin/python" -m pytest -q "$root/tests/interop" || status=1
exit $status
