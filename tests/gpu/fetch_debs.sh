#!/usr/bin/env bash
# Downloads (never installs) the Debian 12 packages moefit builds on into one
# folder, for tests/gpu/run.sh on a machine that has python3 with the torch
# wheel, CMake, ninja and a C++ compiler but none of these -dev packages and no
# network: carry the folder there and run.sh unpacks it into a prefix of its
# own. About 25 MB (10 MB of it Boost's headers). Run on Debian 12 (apt-get
# download fetches this release's builds): tests/gpu/fetch_debs.sh [DIR]
# (default .gpu-debs in the checkout).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$root/.gpu-debs}
mkdir -p "$dir"
cd "$dir"
# The -dev packages of the build, and the shared libraries they and mpirun
# load at run time that a non-Debian machine may lack.
pkgs=(
  libopenmpi-dev libopenmpi3 openmpi-bin openmpi-common libpmix2 libhwloc15 libhwloc-plugins
  libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1 libucx0 libibverbs1 ibverbs-providers
  librdmacm1 libnl-3-200 libnl-route-3-200 libpsm-infinipath1 libpsm2-2 libmunge2 libnuma1
  libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5
  libabsl-dev libabsl20220623
  libprotobuf-dev libprotobuf32 libprotobuf-lite32 protobuf-compiler libprotoc32
  libgtest-dev libgmock-dev googletest nlohmann-json3-dev zlib1g-dev zlib1g
  libboost-dev libboost1.74-dev libpng-dev libpng16-16
)
apt-get download "${pkgs[@]}"
echo "fetch_debs: $(ls "$dir"/*.deb | wc -l) packages, $(du -sh "$dir" | cut -f1) in $dir"
