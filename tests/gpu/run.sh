#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU where python3 holds the
# torch wheel (with CUDA), nvcc, CMake, ninja and a C++ compiler are
# installed, and moefit's other dependencies may not be. Nothing is fetched:
# the Debian 12 packages come from a folder made by tests/gpu/fetch_debs.sh
# and are unpacked (dpkg -x) into a prefix of their own, never into /.
#
#   tests/gpu/run.sh [DEB_DIR]        (default: .gpu-debs in the checkout)
#
# Builds only what the checks need (all cores), runs every test labelled gpu
# (each skips with a message where no GPU is visible) and the expert kernel
# tests on this host's CPU (GPU hosts often have AVX-512 or AMX, which other
# machines lack: every instruction set the host has, for every weight
# format, int4 and FP8 included), then, with a GPU, a
# short training of the demo model: dense layers on the CPU, on the GPU, on
# the GPU in bfloat16, and 2 processes sharing the GPU; the same for LoRA; the
# deepseek_v3 and glm4_moe families on CPU and GPU; bfloat16 and int4 experts
# (LoRA) on CPU and GPU; the experts recomputed in backward, and TF32, on the GPU; a run
# resumed on the GPU from its checkpoint at step 4; and a larger model with
# dense on CPU, on GPU and on GPU in bfloat16; and prints a summary:
#   * dense-on-GPU losses equal dense-on-CPU within 1e-3 relative per step
#     (float32; the GEMMs sum in another order, which grows over the steps),
#     for the demo, LoRA, both families, bfloat16 experts and int4 experts;
#   * bfloat16 dense compute tracks float32 within 2% per step (full, LoRA);
#   * 2 processes sharing the GPU equal 1 process within 1e-3 relative;
#   * the resumed run equals the uninterrupted one within 1e-5, recomputed
#     experts the stored ones within 1e-6, and TF32 float32 within 1%;
#   * the step split (dense GPU / expert CPU / communication) and the bytes
#     across PCIe per step, from the metrics files;
#   * tokens/s of the larger model with dense on GPU against dense on CPU, and
#     in bfloat16 against float32 on the GPU.
# Where no GPU is visible it builds, runs the (skipping) gpu tests and says
# so. Environment: MOEFIT_GPU_PREFIX (default /tmp/moefit-deps),
# MOEFIT_GPU_BUILD (default /tmp/moefit-gpu-build), PYTHON (default python3).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
debs=${1:-$root/.gpu-debs}
prefix=${MOEFIT_GPU_PREFIX:-/tmp/moefit-deps}
build=${MOEFIT_GPU_BUILD:-/tmp/moefit-gpu-build}
python=${PYTHON:-python3}
out=$build/gpu-check
start=$(date +%s)
say() { echo "run.sh [$(($(date +%s) - start)) s]: $*"; }

# 1. The dependencies, into the prefix.
ls "$debs"/*.deb >/dev/null 2>&1 || { echo "run.sh: no .deb files in $debs (make them with tests/gpu/fetch_debs.sh)" >&2; exit 2; }
mkdir -p "$prefix"
for f in "$debs"/*.deb; do
  if command -v dpkg >/dev/null; then
    dpkg -x "$f" "$prefix"
  else  # a .deb is an ar archive; its files are in data.tar.xz
    ar p "$f" data.tar.xz | tar -xJ -C "$prefix"
  fi
done
usr=$prefix/usr
lib=$usr/lib/x86_64-linux-gnu
export PATH=$usr/bin:$PATH
export LD_LIBRARY_PATH=$lib:$lib/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# Open MPI and its PMIx find their plugins and help files from these.
export OPAL_PREFIX=$usr
export PMIX_INSTALL_PREFIX=$usr
export PMIX_MCA_mca_base_component_path=$lib/pmix2/lib/pmix
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say "unpacked $(ls "$debs"/*.deb | wc -l) packages into $prefix"

# 2. Configure and build what the checks run.
torch_prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
say "torch $("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEFIT_BUILD_BENCHMARKS=OFF \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$usr" -DMPI_CXX_COMPILER="$usr/bin/mpicxx.openmpi" \
  -DMPIEXEC_EXECUTABLE="$usr/bin/mpirun.openmpi" -DProtobuf_PROTOC_EXECUTABLE="$usr/bin/protoc" \
  >"$build.configure.log" 2>&1 || { tail -40 "$build.configure.log"; exit 1; }
grep "moefit: torch" "$build.configure.log" || true
targets=(moefit framework_host_transfer_gpu_test parallel_grad_sync_test parallel_node_devices_test
         experts_gemm_test experts_backends_test)
grep -q "NCCL backend: ON" "$build.configure.log" && targets+=(parallel_nccl_communicator_test)
# Keep going past a target that fails: the GPU minutes are few, so whatever
# built is still run, and the run ends non-zero.
status=0
if cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" -- -k 0 >"$build.build.log" 2>&1; then
  say "built ${targets[*]}"
else
  status=1
  grep -E -A8 "error:|Error [0-9]|undefined reference" "$build.build.log" | head -60
  say "the build FAILED (log: $build.build.log); running what was built"
  [ -x "$build/launch/moefit" ] || exit 1
fi

# 3. Every gpu test (and the CPU tests of the same code, as a check of the build).
(cd "$build" && ctest -L gpu --output-on-failure) | tee "$out.ctest.log" | tail -15 || status=1
(cd "$build" && ctest -R "parallel_grad_sync|parallel_node_devices" --output-on-failure | tail -4) \
  || status=1
# The expert kernels on this host's CPU, every instruction set it has.
(cd "$build" && ctest -R "experts_gemm_test|experts_backends_test" --output-on-failure | tail -4) \
  || status=1
say "host CPU:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-); AVX-512 and AMX flags:" \
  "$(grep -m1 -o -E 'avx512[a-z0-9_]*|amx[a-z0-9_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  say "no CUDA device visible: the gpu tests above skipped, and the GPU demo does not run"
  exit $status
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

# 4. The demo model, a few steps each way; metrics files compared below.
mkdir -p "$out"
moefit=$build/launch/moefit
common=(--set train.steps=8 --set train.seq_len=128 --set schedule.warmup_steps=2
        --set logging.log_every=4)
threads=$(( $(nproc) / 2 ))
run() {  # name, processes, micro-batch, extra sets...
  local name=$1 np=$2 mb=$3
  shift 3
  local cmd=("$moefit" train "${common[@]}" --set train.micro_batch_size="$mb"
             --set logging.metrics_file="$out/$name.jsonl" "$@")
  rm -f "$out/$name.jsonl"
  if [ "$np" = 1 ]; then
    MOEFIT_NUM_THREADS=$threads "${cmd[@]}" >"$out/$name.log" 2>&1
  else
    "$usr/bin/mpirun.openmpi" -np "$np" --oversubscribe --bind-to none -x MOEFIT_NUM_THREADS=$((threads / np)) \
      -x LD_LIBRARY_PATH -x OPAL_PREFIX "${cmd[@]}" >"$out/$name.log" 2>&1
  fi || { tail -20 "$out/$name.log"; say "demo '$name' FAILED"; status=1; return 0; }
  say "demo '$name' done"
}
run cpu 1 8 --set parallel.device=cpu
run gpu 1 8 --set parallel.device=cuda
run gpu_bf16 1 8 --set parallel.device=cuda --set train.dense_dtype=bfloat16
run gpu_shared_np2 2 4 --set parallel.device=cuda --set parallel.ranks_per_gpu=2
# LoRA (adapters on every dense linear map and the experts), the other two
# families, and a resume from a checkpoint, each on the GPU against the CPU or
# the uninterrupted run.
lora=(--set train.mode=lora --set lora.rank=8 --set lora.alpha=16
      --set "lora.target_modules=[all-linear,experts]")
run lora_cpu 1 8 --set parallel.device=cpu "${lora[@]}"
run lora_gpu 1 8 --set parallel.device=cuda "${lora[@]}"
run lora_gpu_bf16 1 8 --set parallel.device=cuda --set train.dense_dtype=bfloat16 "${lora[@]}"
run lora_shared_np2 2 4 --set parallel.device=cuda --set parallel.ranks_per_gpu=2 "${lora[@]}"
deepseek=(--set model.model_type=deepseek_v3 --set model.router_aux_loss_coef=0 --set model.q_lora_rank=64
          --set model.kv_lora_rank=32 --set model.qk_nope_head_dim=32 --set model.qk_rope_head_dim=16
          --set model.v_head_dim=32 --set model.n_group=4 --set model.topk_group=2
          --set model.first_k_dense_replace=1 --set model.aux_loss_alpha=0.001)
run deepseek_cpu 1 8 --set parallel.device=cpu "${deepseek[@]}"
run deepseek_gpu 1 8 --set parallel.device=cuda "${deepseek[@]}"
glm=(--set model.model_type=glm4_moe --set model.router_aux_loss_coef=0 --set model.attention_bias=true
     --set model.use_qk_norm=true --set model.n_group=2 --set model.topk_group=1
     --set model.first_k_dense_replace=1 --set model.aux_loss_alpha=0.001)
run glm_cpu 1 8 --set parallel.device=cpu "${glm[@]}"
run glm_gpu 1 8 --set parallel.device=cuda "${glm[@]}"
# bfloat16 experts (the activations cross PCIe in bfloat16), the experts
# recomputed in backward, and TF32 products.
run experts_bf16_cpu 1 8 --set parallel.device=cpu --set experts.dtype=bfloat16
run experts_bf16_gpu 1 8 --set parallel.device=cuda --set experts.dtype=bfloat16
run experts_int4_cpu 1 8 --set parallel.device=cpu --set experts.dtype=int4 "${lora[@]}"
run experts_int4_gpu 1 8 --set parallel.device=cuda --set experts.dtype=int4 "${lora[@]}"
run recompute_gpu 1 8 --set parallel.device=cuda --set train.recompute=experts
run tf32_gpu 1 8 --set parallel.device=cuda --set train.allow_tf32=true
rm -rf "$out/ckpt" "$out/ckpt_resumed"
run saved_gpu 1 8 --set parallel.device=cuda --set checkpoint.save_dir="$out/ckpt" \
  --set checkpoint.save_every_steps=4
run resumed_gpu 1 8 --set parallel.device=cuda --set checkpoint.save_dir="$out/ckpt_resumed" \
  --set checkpoint.resume_from="$out/ckpt/step-00000004"
# A larger dense part (hidden 1024), for the speed of dense on GPU against CPU.
big=(--set model.hidden_size=1024 --set model.intermediate_size=2048 --set model.moe_intermediate_size=512
     --set model.num_attention_heads=8 --set model.num_key_value_heads=4 --set model.head_dim=128)
run big_cpu 1 8 --set parallel.device=cpu "${big[@]}"
run big_gpu 1 8 --set parallel.device=cuda "${big[@]}"
run big_gpu_bf16 1 8 --set parallel.device=cuda --set train.dense_dtype=bfloat16 "${big[@]}"
# Hot experts on the GPU (8 of the demo's 4 x 8 experts, reconsidered every
# step on counters of half-life 4): the losses of the run without, the share
# of rows the GPU computed, the step time with and without.
cache=(--set experts.gpu_cache_experts=8 --set experts.gpu_cache_every_steps=1
       --set logging.routing_half_life_steps=4)
run gpu_cache 1 8 --set parallel.device=cuda "${cache[@]}"
run lora_gpu_cache 1 8 --set parallel.device=cuda "${lora[@]}" "${cache[@]}"
run big_gpu_cache 1 8 --set parallel.device=cuda "${big[@]}" "${cache[@]}"

"$python" - "$out" <<'PY' || status=1
import glob, json, os, sys
out = sys.argv[1]
runs = {os.path.basename(p)[:-len(".jsonl")]: {m["step"]: m for m in map(json.loads, open(p))}
        for p in glob.glob(f"{out}/*.jsonl")}
ok = True
def worst(a, b):
    """The largest relative loss difference of a's steps from the same steps of b."""
    return max(abs(m["loss"] - runs[b][s]["loss"]) / abs(runs[b][s]["loss"]) for s, m in runs[a].items())
def later_steps(name):
    """A run's metrics after its first step (which warms up), or its only one."""
    return [runs[name][s] for s in sorted(runs[name])[1:]] or list(runs[name].values())
def compare(label, a, b, rel):
    """Every step a has, against the same step of b (b has at least a's steps)."""
    global ok
    if not runs.get(a) or not runs.get(b) or not set(runs[a]) <= set(runs[b]):
        print(f"  {label}: not compared (a run failed): FAILED")
        ok = False
        return
    worst_ab = worst(a, b)
    ok &= worst_ab <= rel
    print(f"  {label}: largest relative loss difference {worst_ab:.2e} (limit {rel:g}) "
          f"{'ok' if worst_ab <= rel else 'FAILED'}")
def losses(name):
    return " ".join(f"{runs[name][s]['loss']:.4f}" for s in sorted(runs.get(name, {})))
print("summary:")
print("  losses cpu:      " + losses("cpu"))
print("  losses gpu:      " + losses("gpu"))
print("  losses gpu bf16: " + losses("gpu_bf16"))
compare("dense on GPU vs on CPU (float32)", "gpu", "cpu", 1e-3)
compare("bfloat16 vs float32 dense on GPU", "gpu_bf16", "gpu", 2e-2)
compare("2 processes sharing the GPU vs 1", "gpu_shared_np2", "gpu", 1e-3)
compare("LoRA on GPU vs on CPU", "lora_gpu", "lora_cpu", 1e-3)
compare("LoRA, bfloat16 vs float32 dense on GPU", "lora_gpu_bf16", "lora_gpu", 2e-2)
compare("LoRA, 2 processes sharing the GPU vs 1", "lora_shared_np2", "lora_gpu", 1e-3)
compare("deepseek_v3 on GPU vs on CPU", "deepseek_gpu", "deepseek_cpu", 1e-3)
compare("glm4_moe on GPU vs on CPU", "glm_gpu", "glm_cpu", 1e-3)
compare("resumed at step 4 on GPU vs uninterrupted", "resumed_gpu", "saved_gpu", 1e-5)
compare("bfloat16 experts, dense on GPU vs on CPU", "experts_bf16_gpu", "experts_bf16_cpu", 1e-3)
compare("int4 experts (LoRA), dense on GPU vs on CPU", "experts_int4_gpu", "experts_int4_cpu", 1e-3)
compare("experts recomputed in backward on GPU vs stored", "recompute_gpu", "gpu", 1e-6)
compare("TF32 vs float32 dense on GPU", "tf32_gpu", "gpu", 1e-2)
compare("hot experts on the GPU vs none", "gpu_cache", "gpu", 1e-3)
compare("LoRA, hot experts on the GPU vs none", "lora_gpu_cache", "lora_gpu", 1e-3)
for name, base in (("gpu_cache", "gpu"), ("lora_gpu_cache", "lora_gpu"), ("big_gpu_cache", "big_gpu")):
    if not runs.get(name) or not runs.get(base):
        continue
    cached, plain = later_steps(name), later_steps(base)
    share = sum(m.get("gpu_cache_share", 0.0) for m in cached) / len(cached)
    step_with = sum(m["step_s"] for m in cached) / len(cached)
    step_without = sum(m["step_s"] for m in plain) / len(plain)
    print(f"  {name}: {share:.1%} of the expert rows computed on the GPU (steps 2-); step "
          f"{step_with*1e3:.1f} ms with the cache, {step_without*1e3:.1f} ms without "
          f"({step_with / step_without:.2f}x)")
for name in ("gpu", "gpu_bf16", "gpu_shared_np2", "lora_gpu", "experts_bf16_gpu", "big_gpu",
             "big_gpu_bf16"):
    if not runs.get(name):
        continue
    steps = later_steps(name)
    n = len(steps)
    step = sum(m["step_s"] for m in steps) / n
    expert = sum(m["expert_s"] for m in steps) / n
    comm = sum(m["comm_s"] for m in steps) / n
    pcie = sum(int(m["pcie_bytes"]) for m in steps) / n
    print(f"  step split {name} (rank 0, mean of steps 2-): {step*1e3:.1f} ms = dense GPU + other "
          f"{(step-expert-comm)*1e3:.1f} ms, expert CPU {expert*1e3:.1f} ms, communication "
          f"{comm*1e3:.1f} ms; PCIe {pcie/2**20:.2f} MiB per step")
def tokens_per_s(name):
    steps = later_steps(name)
    return sum(m["tokens_per_s"] for m in steps) / len(steps)
if runs.get("big_cpu") and runs.get("big_gpu"):
    cpu, gpu = tokens_per_s("big_cpu"), tokens_per_s("big_gpu")
    print(f"  hidden 1024: dense on GPU {gpu:.0f} tokens/s, on CPU {cpu:.0f} ({gpu / cpu:.2f}x; "
          f"largest relative loss difference {worst('big_gpu', 'big_cpu'):.2e}, for information)")
    if runs.get("big_gpu_bf16"):
        bf16 = tokens_per_s("big_gpu_bf16")
        print(f"  hidden 1024: dense on GPU in bfloat16 {bf16:.0f} tokens/s ({bf16 / gpu:.2f}x float32)")
sys.exit(0 if ok else 1)
PY
grep -h "Passed\|Failed\|Skipped\|tests passed" "$out.ctest.log" | sed 's/^/  ctest -L gpu: /' || true
say "done"
exit $status
