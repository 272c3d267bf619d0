#!/usr/bin/env bash
# Installs what moefit needs on Debian 12 and configures + builds it.
#
# Idempotent: packages already present are not reinstalled, and the Python
# environment that carries LibTorch (the PyPI torch wheel) lives outside the
# checkout, in $MOEFIT_VENV (default ~/.cache/moefit/venv), so a fresh clone
# reuses it instead of downloading several GB again.
#
# Usage: launch/scripts/setup.sh            # install + build (Release) into build/
# Environment: MOEFIT_VENV, MOEFIT_BUILD_DIR, MOEFIT_JOBS
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${MOEFIT_VENV:-$HOME/.cache/moefit/venv}
build=${MOEFIT_BUILD_DIR:-$root/build}
jobs=${MOEFIT_JOBS:-$(nproc)}

# Versions of the Python side, pinned so every machine builds on the same LibTorch.
torch_spec="torch==2.15.0"
py_clients=(transformers==5.24.0 peft==0.21.2 safetensors==0.8.0 tensorboard==2.21.0 compressed-tensors==0.20.1 pytest numpy)

die() { echo "moefit setup: $*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@";
  elif command -v sudo >/dev/null; then sudo "$@";
  else die "need root or sudo to run: $*"; fi
}

# --- Debian packages -------------------------------------------------------
apt_pkgs=(build-essential cmake git pkg-config python3 python3-venv
          libopenmpi-dev openmpi-bin libtbb-dev libabsl-dev
          libprotobuf-dev protobuf-compiler libgtest-dev libgmock-dev
          libbenchmark-dev nlohmann-json3-dev zlib1g-dev libboost-dev libpng-dev)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "moefit setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  log=$(mktemp)
  as_root apt-get update -qq >"$log" 2>&1 || { cat "$log" >&2; die "apt-get update failed"; }
  as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$log" 2>&1 \
    || { tail -n 30 "$log" >&2; die "could not install Debian packages: ${missing[*]}"; }
  rm -f "$log"
fi

# --- Python environment with LibTorch and the interop clients --------------
pick_python() {
  for py in python3.11 python3; do
    if command -v "$py" >/dev/null && "$py" -c 'import venv, ensurepip' 2>/dev/null; then
      command -v "$py"; return 0; fi
  done
  return 1
}
if [ ! -x "$venv/bin/python" ]; then
  py=$(pick_python) || die "no python3 with the venv module (apt-get install python3-venv)"
  echo "moefit setup: creating Python environment $venv"
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv" || die "could not create $venv"
fi
stamp="$venv/.moefit-requirements"
want="$torch_spec ${py_clients[*]}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "moefit setup: installing $want into $venv (first time only)"
  "$venv/bin/pip" install -q --upgrade pip >/dev/null || die "pip upgrade failed in $venv"
  "$venv/bin/pip" install -q "$torch_spec" "${py_clients[@]}" || die "pip install of $want failed"
  echo "$want" > "$stamp"
fi
torch_prefix=$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)') \
  || die "torch is not importable from $venv"

# --- Configure and build ---------------------------------------------------
cuda_args=()
[ -x /usr/local/cuda/bin/nvcc ] && cuda_args+=(-DCUDAToolkit_ROOT=/usr/local/cuda -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix" -DMOEFIT_PYTHON="$venv/bin/python" "${cuda_args[@]}" >/dev/null \
  || die "cmake configure failed (see output above)"
cmake --build "$build" -j "$jobs" || die "build failed"
