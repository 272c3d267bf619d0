#!/usr/bin/env bash
# Runs the README's quick start as written: every fenced block that follows a
# `<!-- quickstart -->` line of README.md, in order, in one bash shell with
# -e, so that each command must exit 0. The commands name paths relative to
# the checkout (`build/launch/moefit`, `data/`): they run in a scratch
# directory where `build` is the build directory under test and every other
# top-level entry a link to the checkout's. The blocks themselves choose where
# their output goes (the README's $OUT), and that is removed at the end.
#
# Usage: tests/launch/readme_quickstart.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1
build=$2
readme=$src/README.md

work=$(mktemp -d)
trap 'rm -rf "$work" ${OUT:+"$OUT"}' EXIT

# A marker must be followed by a fenced block (blank lines between allowed);
# the block runs to the next fence line.
awk -v file="$readme" '
  /^<!-- quickstart -->[[:space:]]*$/ { armed = 1; next }
  armed && /^[[:space:]]*$/ { next }
  armed && /^```/ { armed = 0; inside = 1; blocks++; next }
  armed { printf "%s:%d: <!-- quickstart --> is not followed by a fenced block\n", file, NR > "/dev/stderr"; bad = 1; exit }
  inside && /^```/ { inside = 0; print ""; next }
  inside { print }
  END {
    if (bad) exit 1
    if (inside) { printf "%s: a quickstart block is not closed\n", file > "/dev/stderr"; exit 1 }
    if (blocks == 0) { printf "%s: no <!-- quickstart --> block\n", file > "/dev/stderr"; exit 1 }
  }' "$readme" >"$work/quickstart.sh"

ln -s "$build" "$work/build"
for entry in "$src"/*; do
  [ "$(basename "$entry")" = build ] || ln -s "$entry" "$work/$(basename "$entry")"
done
cd "$work"
echo "readme_quickstart: running the quick start of $readme:"
cat quickstart.sh
echo "--"
set -x
# shellcheck source=/dev/null
source ./quickstart.sh
set +x
echo "readme_quickstart: every command exited 0"
