"""LoRA at a trillion-parameter model's layer widths, in bfloat16, FP8 and int4.

Writes, without any download, checkpoint directories shaped like Kimi-K2's
layers (hidden 7168, routed experts of width 2048, multi-head latent attention
with q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128,
64 heads; top-8 sigmoid routing with a correction bias, one shared expert)
but with fewer layers and experts (default: 2 MoE layers of 32 experts, 2.8B
expert parameters; --experts 64 doubles them), in three formats:

  bf16  every weight bfloat16;
  fp8   DeepSeek's block format: each Linear weight F8_E4M3 with an fp32
        `weight_scale_inv` per 128 x 128 block (quant_method "fp8");
  int4  compressed-tensors' pack-quantized format as Kimi-K2-Thinking ships
        it: the routed experts' `weight_packed` (int32, eight 4-bit values a
        word), `weight_scale` (bf16, one per 32 inputs) and `weight_shape`,
        symmetric, quantized and packed by the compressed-tensors library;
        everything else bfloat16.

Every tensor is drawn from its own seeded generator and written as it is
drawn (the files are streamed, never held whole): the three formats quantize
the same draw. Then, per format, `moefit train` runs LoRA (rank 16 on the
attention projections and every routed expert, dense layers on the CPU) from
the directory at 1 and 2 processes (mpirun; each of N processes gets
--threads / N compute threads, --threads defaulting to the core count),
each from a cold page cache, and the benchmark prints per format and process
count:

  * peak RSS per process (the largest VmHWM over the ranks, as moefit reports
    it at the end of the run);
  * bytes held per expert parameter: the process's routed-expert tensors
    (weights, scales) plus the expert kernels' kept packs of them, over its
    expert parameters (moefit's end-of-run report);
  * `moefit plan`'s prediction for the same run and its error against the
    measured peak. The plan sizes a node of GPU servers; here each process is
    a node and its dense part lives in RAM, so the prediction is the plan's
    host RAM per node without its fixed 32 GiB allowance, plus what it puts on
    a GPU (the frozen dense weights, the attention adapters, the dense
    activations), plus this machine's fixed cost of a moefit process (LibTorch,
    MPI, the corpus), measured by running the built-in tiny model the same way;
  * the load: rank 0's bytes and seconds as moefit reports them, against a
    sequential read of the same bytes from a cold page cache (the whole
    checkpoint is read once, each file dropped from the page cache first with
    posix_fadvise(DONTNEED), and rank 0's bytes are timed at that rate);
  * tokens/s, and the routed experts' GFLOP/s on rank 0 (forward + dX of its
    rows, 12 x rows x hidden x moe_intermediate per layer, from the metrics
    file's per-expert token counts over its expert_s; the adapters' low-rank
    products are not counted) against a float32 GEMM ceiling measured in the
    same run (torch.mm of 2048^3 on the process's thread count).

It also times one core's forward + dX of one expert in FP8 and in int4 at 16
and 64 rows at the same widths (build/benchmarks/expert_kernel_bench), packing
per call and with the weights packed ahead, and prints the CPU's flags and the
goals, met or not: at most 1.15 bytes per expert parameter in FP8 and 0.6 in
int4, the plan within 10% of every measured peak, int4's forward + dX at least
as fast as FP8's at 16 and more rows per expert. A format that moefit cannot
run is reported with moefit's reason; the others still run.

    cmake --build build -j2 --target moefit expert_kernel_bench
    ~/.cache/moefit/venv/bin/python benchmarks/scale/scale_bench.py \\
        [--build build] [--work-dir DIR] [--keep] [--quick] [--formats bf16,fp8,int4] \\
        [--procs 1,2] [--moe-layers 2] [--experts 32] [--dense-layers 0] [--steps 4] \\
        [--packed-weight-gb 2]

The defaults need about 11 GB of disk (--experts 64: 22 GB) and fit in 24 GiB
of RAM; the checkpoints go to a new run-* directory under --work-dir (default:
<build>/scale_bench), deleted at the end unless --keep. --quick runs a
narrower model (hidden 1024) end to end in one to two minutes; ctest runs it
(benchmark_scale_quick).
"""
import argparse
import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import torch

FORMATS = ("bf16", "fp8", "int4")
INT4_GROUP = 32
FP8_BLOCK = 128
# A LoRA run on a frozen base, as the plan's lora mode counts it.
LORA_RANK = 16
ATTENTION = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
GOAL_BYTES = {"fp8": 1.15, "int4": 0.6}
GOAL_PLAN_ERROR = 0.10
GOAL_KERNEL_ROWS = (16, 64)
# mpirun refuses to start as root without these (containers).
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@dataclasses.dataclass
class Shape:
    hidden: int = 7168
    inter: int = 2048  # moe_intermediate_size (the shared expert's too)
    experts: int = 32
    moe_layers: int = 2
    dense_layers: int = 0  # first_k_dense_replace, each a dense MLP of dense_inter
    dense_inter: int = 18432
    heads: int = 64
    q_lora: int = 1536
    kv_lora: int = 512
    nope: int = 128
    rope: int = 64
    v_head: int = 128
    top_k: int = 8
    vocab: int = 256  # moefit's shipped corpus is bytes

    @property
    def layers(self):
        return self.dense_layers + self.moe_layers

    def expert_params(self):
        return self.moe_layers * self.experts * 3 * self.hidden * self.inter


QUICK = dict(hidden=1024, inter=256, experts=16, dense_inter=2048, heads=8, q_lora=256,
             kv_lora=128, nope=32, rope=16, v_head=32)


# --- the checkpoint ---------------------------------------------------------

def config_json(s: Shape, fmt):
    """Kimi-K2's config.json at these widths, with the format's quantization_config."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": s.vocab, "hidden_size": s.hidden, "intermediate_size": s.dense_inter,
        "moe_intermediate_size": s.inter, "num_hidden_layers": s.layers,
        "first_k_dense_replace": s.dense_layers, "moe_layer_freq": 1,
        "num_attention_heads": s.heads, "num_key_value_heads": s.heads,
        "q_lora_rank": s.q_lora, "kv_lora_rank": s.kv_lora, "qk_nope_head_dim": s.nope,
        "qk_rope_head_dim": s.rope, "v_head_dim": s.v_head, "n_routed_experts": s.experts,
        "n_shared_experts": 1, "num_experts_per_tok": s.top_k, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "aux_loss_alpha": 0.001, "seq_aux": True,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 1,
    }
    if fmt == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    elif fmt == "int4":
        cfg["quantization_config"] = int4_scheme(s).model_dump()
    return cfg


def int4_scheme(s: Shape):
    """Kimi-K2-Thinking's QuantizationConfig: int4 in groups of 32, symmetric,
    on every Linear but the ones it ignores (all but the routed experts)."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=INT4_GROUP)
    ignore = ["lm_head"]
    for name, _, kind in tensors(s):
        if kind == "linear":
            ignore.append(name[:-len(".weight")])
    return QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        format="pack-quantized", quantization_status="compressed", ignore=ignore)


def tensors(s: Shape):
    """(name, shape, kind) of every tensor of the model, shard by shard in the
    order they are written. kind: norm (ones), bias (zeros, float32), router,
    embed, linear (a dense Linear), expert (a routed expert's Linear)."""
    out = [("model.embed_tokens.weight", (s.vocab, s.hidden), "embed"),
           ("model.norm.weight", (s.hidden,), "norm"),
           ("lm_head.weight", (s.vocab, s.hidden), "embed")]
    for l in range(s.layers):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (s.hidden,), "norm"),
                (p + "post_attention_layernorm.weight", (s.hidden,), "norm"),
                (p + "self_attn.q_a_proj.weight", (s.q_lora, s.hidden), "linear"),
                (p + "self_attn.q_a_layernorm.weight", (s.q_lora,), "norm"),
                (p + "self_attn.q_b_proj.weight", (s.heads * (s.nope + s.rope), s.q_lora), "linear"),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (s.kv_lora + s.rope, s.hidden),
                 "linear"),
                (p + "self_attn.kv_a_layernorm.weight", (s.kv_lora,), "norm"),
                (p + "self_attn.kv_b_proj.weight", (s.heads * (s.nope + s.v_head), s.kv_lora),
                 "linear"),
                (p + "self_attn.o_proj.weight", (s.hidden, s.heads * s.v_head), "linear")]
        if l < s.dense_layers:
            out += [(p + f"mlp.{m}_proj.weight", shape, "linear")
                    for m, shape in (("gate", (s.dense_inter, s.hidden)),
                                     ("up", (s.dense_inter, s.hidden)),
                                     ("down", (s.hidden, s.dense_inter)))]
            continue
        out += [(p + "mlp.gate.weight", (s.experts, s.hidden), "router"),
                (p + "mlp.gate.e_score_correction_bias", (s.experts,), "bias")]
        out += [(p + f"mlp.shared_experts.{m}_proj.weight", shape, "linear")
                for m, shape in (("gate", (s.inter, s.hidden)), ("up", (s.inter, s.hidden)),
                                 ("down", (s.hidden, s.inter)))]
        for e in range(s.experts):
            out += [(p + f"mlp.experts.{e}.{m}_proj.weight", shape, "expert")
                    for m, shape in (("gate", (s.inter, s.hidden)), ("up", (s.inter, s.hidden)),
                                     ("down", (s.hidden, s.inter)))]
    return out


def shard_of(name, s: Shape):
    """Shard 0 holds the embeddings and the final norm; shard l + 1 layer l."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) + 1 if m else 0


def stored(name, shape, kind, fmt):
    """What a format stores for one tensor: [(name, safetensors dtype, shape)]."""
    if kind == "bias":
        return [(name, "F32", shape)]
    quantized = kind == "expert" or (kind == "linear" and fmt == "fp8")
    if fmt == "fp8" and quantized:
        blocks = (math.ceil(shape[0] / FP8_BLOCK), math.ceil(shape[1] / FP8_BLOCK))
        return [(name, "F8_E4M3", shape), (name + "_scale_inv", "F32", blocks)]
    if fmt == "int4" and kind == "expert":
        rows, cols = shape
        return [(name + "_packed", "I32", (rows, math.ceil(cols / 8))),
                (name + "_scale", "BF16", (rows, math.ceil(cols / INT4_GROUP))),
                (name + "_shape", "I64", (2,))]
    return [(name, "BF16", shape)]


ELEMENT_BYTES = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "I32": 4, "I64": 8}


class Writes:
    """One thread that writes tensors' bytes to their files, in the order
    given, while the next tensors are drawn and quantized; at most `pending`
    tensors wait."""

    def __init__(self, pending=8):
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.queue, self.pending = collections.deque(), pending

    def write(self, file, tensor):
        while len(self.queue) >= self.pending:
            self.queue.popleft().result()
        data = tensor.contiguous().view(torch.uint8).numpy()
        self.queue.append(self.pool.submit(file.write, memoryview(data)))

    def drain(self):
        while self.queue:
            self.queue.popleft().result()


class SafetensorsWriter:
    """One safetensors file written tensor by tensor: the header (every name,
    dtype, shape and offset) first, from the list of what will follow, then
    each tensor's bytes in that order."""

    def __init__(self, path, entries, writes):
        self.path, self.entries, self.next, self.writes = path, entries, 0, writes
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape in entries:
            size = math.prod(shape) * ELEMENT_BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data 8-byte aligned, as the library writes it
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.data_bytes = offset

    def write(self, name, tensor):
        want_name, dtype, shape = self.entries[self.next]
        assert name == want_name and tuple(tensor.shape) == tuple(shape), (name, want_name)
        self.writes.write(self.file, tensor)
        self.next += 1

    def close(self):
        assert self.next == len(self.entries), f"{self.path}: {self.next} of {len(self.entries)}"
        self.writes.drain()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def draw(name, shape, kind, seed):
    """The tensor's values: its own generator, seeded by the run's seed and its name."""
    if kind == "norm":
        return torch.ones(shape)
    if kind == "bias":
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, 0.02, generator=g)


def quantize_fp8(w):
    """[rows, cols] float32 -> (e4m3, fp32 scale_inv per 128 x 128 block =
    amax / 448), DeepSeek-V3's block format; partial blocks at the edges."""
    rows, cols = w.shape
    r, c = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = torch.nn.functional.pad(w, (0, c * FP8_BLOCK - cols, 0, r * FP8_BLOCK - rows))
    blocks = padded.view(r, FP8_BLOCK, c, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(r * FP8_BLOCK, c * FP8_BLOCK)[:rows, :cols], scale


def quantize_int4(w, scheme):
    """[rows, cols] -> compressed-tensors' weight_packed, weight_scale and
    weight_shape, by the library: min-max scales per group of 32 inputs
    (calculate_qparams), then PackedQuantizationCompressor.compress."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams
    w = w.to(torch.bfloat16)
    rows, cols = w.shape
    groups = w.view(rows, cols // INT4_GROUP, INT4_GROUP)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    return PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)


def write_checkpoints(s: Shape, formats, root, seed):
    """The model in each format under root/<format>/, all from one draw."""
    scheme = int4_scheme(s).config_groups["group_0"] if "int4" in formats else None
    if "int4" in formats and (s.hidden % INT4_GROUP or s.inter % INT4_GROUP):
        raise SystemExit(f"hidden and moe_intermediate must be multiples of {INT4_GROUP}")
    all_tensors = tensors(s)
    num_shards = s.layers + 1
    shard_name = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    dirs = {}
    for fmt in formats:
        d = root / fmt
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(config_json(s, fmt), indent=2))
        weight_map, total = {}, 0
        for name, shape, kind in all_tensors:
            for n, dtype, sh in stored(name, shape, kind, fmt):
                weight_map[n] = shard_name[shard_of(name, s)]
                total += math.prod(sh) * ELEMENT_BYTES[dtype]
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        dirs[fmt] = d
    writes = Writes()
    for shard in range(num_shards):
        mine = [t for t in all_tensors if shard_of(t[0], s) == shard]
        writers = {fmt: SafetensorsWriter(dirs[fmt] / shard_name[shard],
                                          [e for t in mine for e in stored(*t, fmt)], writes)
                   for fmt in formats}
        for name, shape, kind in mine:
            w = draw(name, shape, kind, seed)
            for fmt, out in writers.items():
                entries = stored(name, shape, kind, fmt)
                if entries[0][1] == "F8_E4M3":
                    q, scale = quantize_fp8(w)
                    out.write(name, q)
                    out.write(name + "_scale_inv", scale)
                elif entries[0][0].endswith("_packed"):
                    c = quantize_int4(w, scheme)
                    for suffix in ("_packed", "_scale", "_shape"):
                        out.write(name + suffix, c["weight" + suffix])
                else:
                    out.write(name, w.to(torch.float32 if entries[0][1] == "F32"
                                         else torch.bfloat16))
        for out in writers.values():
            out.close()
    return dirs


# --- measurements -----------------------------------------------------------

def checkpoint_files(d):
    return sorted(d.glob("*.safetensors"))


def drop_from_page_cache(files):
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_read_rate(files):
    """Bytes per second of reading the files once, in order, from a cold page cache."""
    drop_from_page_cache(files)
    buf = memoryview(bytearray(16 << 20))
    total, start = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    seconds = time.perf_counter() - start
    drop_from_page_cache(files)
    return total, seconds


def gemm_gflops(threads):
    """The float32 GEMM ceiling: torch.mm of 2048^3 on `threads` threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 1.5:
        torch.mm(a, b)
        n += 1
    return 2 * 2048 ** 3 * n / (time.perf_counter() - start) / 1e9


def size_bytes(text):
    value, unit = text.split()
    return float(value) * {"GiB": 2 ** 30, "MiB": 2 ** 20}[unit]


def parse_log(out):
    """What moefit printed: load, kernels, end-of-run memory (largest over ranks)."""
    r = {}
    if m := re.search(r"loaded .*: \d+ tensors, ([\d.]+) GB read by rank 0 in ([\d.]+) s", out):
        r["load_gb"], r["load_s"] = float(m.group(1)), float(m.group(2))
    if m := re.search(r"moefit: expert kernels (\S+).*\(CPU flags: (.*)\)$", out, re.M):
        r["isa"], r["cpu_flags"] = m.group(1), m.group(2)
    ends = re.findall(r"moefit: memory at the end, (?:rank 0|largest over \d+ ranks): peak RSS "
                      r"([\d.]+ [GM]iB); routed experts ([\d.]+ [GM]iB) \+ ([\d.]+ [GM]iB) kept "
                      r"packs for (\d+) parameters \(([\d.]+) \+ ([\d.]+) bytes each\)", out)
    if ends:
        peak, tensors_, packs, params, per_t, per_p = ends[-1]  # the largest when there are ranks
        r.update(peak_rss=size_bytes(peak), expert_bytes=size_bytes(tensors_),
                 pack_bytes=size_bytes(packs), expert_params=int(params),
                 bytes_per_param=float(per_t) + float(per_p), tensor_bytes_per_param=float(per_t))
    return r


def moefit_env(threads):
    return dict(os.environ, **MPI_ENV, MOEFIT_NUM_THREADS=str(threads),
                OMP_NUM_THREADS=str(threads))


def launcher(procs):
    return [] if procs == 1 else ["mpirun", "-np", str(procs), "--oversubscribe", "--bind-to",
                                  "none"]


def run_moefit(args, procs, threads, sets, log_path):
    cmd = launcher(procs) + [str(args.moefit), "train"]
    for s in sets:
        cmd += ["--set", s]
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=moefit_env(threads),
                            timeout=args.run_timeout).returncode
    return rc, log_path.read_text()


def lora_sets(args, metrics, extra):
    return [f"train.steps={args.steps}", f"train.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.batch}", "train.mode=lora", f"lora.rank={LORA_RANK}",
            f"lora.alpha={2 * LORA_RANK}", "schedule.warmup_steps=0", "optimizer.lr=1e-4",
            f"experts.packed_weight_gb={args.packed_weight_gb}",
            "parallel.device=cpu", f"logging.metrics_file={metrics}", *extra]


def fixed_cost(args, procs, threads, work):
    """Peak RSS of a moefit process that holds next to no model: the built-in
    tiny model, the same batches, the same launch."""
    rc, out = run_moefit(args, procs, threads,
                         [f"train.steps=2", f"train.seq_len={args.seq_len}",
                          f"train.micro_batch_size={args.batch}", "parallel.device=cpu",
                          f"logging.metrics_file={work / 'fixed.jsonl'}"],
                         work / f"fixed-np{procs}.log")
    if rc != 0:
        raise SystemExit(f"moefit failed on its built-in model (exit {rc}):\n{out[-3000:]}")
    return parse_log(out)["peak_rss"]


def plan_prediction(args, d, fmt, procs, isa, base_rss):
    """moefit plan's figures for one process of this run (see the top of the file)."""
    cmd = [str(args.moefit), "plan", "--model", str(d / "config.json"), "--nodes", str(procs),
           "--ram-gb", str(args.ram_gib), "--gpus-per-node", "1", "--gpu-gb", "1000000",
           "--mode", "lora", "--lora-rank", str(LORA_RANK), "--expert-dtype", fmt,
           "--seq-len", str(args.seq_len), "--micro-batch", str(args.batch),
           "--cpu-isa", isa, "--packed-weight-gb", str(args.packed_weight_gb), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode not in (0, 3):
        raise SystemExit(f"moefit plan failed (exit {out.returncode}): {out.stderr}")
    p = json.loads(out.stdout)
    ram, gpu = p["ram_per_node"], p["gpu_per_gpu"]
    return (ram["total"] - ram["reserve"] + gpu["dense_weights"] + gpu["lora"] + gpu["activations"]
            + base_rss)


def plan_isa(isa):
    """moefit plan's --cpu-isa for the kernels moefit ran (portable packs as avx2)."""
    return isa if isa in ("avx2", "avx512", "avx512_bf16", "amx_bf16") else "avx2"


def expert_rate(metrics, s: Shape, procs):
    """Rank 0's routed-expert GFLOP/s and tokens/s over the steps after the first."""
    steps = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
    own = s.experts // procs  # rank 0's experts: the first block
    rates, tokens = [], []
    for st in steps:
        rows = sum(sum(layer["tokens_per_expert"][:own]) for layer in st["moe_layers"])
        rates.append(12 * rows * s.hidden * s.inter / st["expert_s"] / 1e9)
        tokens.append(st["tokens_per_s"])
    return statistics.median(rates), statistics.median(tokens), \
        statistics.median(st["expert_s"] / st["step_s"] for st in steps)


def kernel_times(args, s: Shape):
    """One core's forward + dX of one expert in FP8 and int4 (ms), per call
    and packed ahead, from expert_kernel_bench: {(dtype, rows): (call, kept)}."""
    bench = args.build / "benchmarks" / "expert_kernel_bench"
    if not bench.is_file():
        return None, f"{bench} is not built (cmake --build {args.build} --target expert_kernel_bench)"
    rows = ",".join(str(r) for r in GOAL_KERNEL_ROWS)
    out = subprocess.run([str(bench), f"--hidden={s.hidden}", f"--inter={s.inter}",
                          f"--rows={rows}", "--experts=4", "--seconds=0.3"],
                         capture_output=True, text=True, env=moefit_env(1), timeout=600)
    if out.returncode != 0:
        return None, f"expert_kernel_bench failed (exit {out.returncode}): {out.stderr[-500:]}"
    times = {}
    for line in out.stdout.splitlines():
        f = line.split()
        # isa dtype rows fwd+dX +dW GFLOP/s vs-mm mem-floor vs-mem kept kept/mem
        if len(f) == 11 and f[1] in ("fp8", "int4") and f[2].isdigit():
            times[f[1], int(f[2])] = (float(f[3]), float(f[9]))
    return times, out.stdout.splitlines()[0]


# --- the run ----------------------------------------------------------------

def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
        else:
            flags = set()
    wanted = ["avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vbmi", "amx_bf16"]
    return " ".join(f for f in wanted if f in flags) or "none of " + " ".join(wanted)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", type=pathlib.Path,
                   default=pathlib.Path(os.environ.get("MOEFIT_BUILD_DIR", "build")))
    p.add_argument("--work-dir", type=pathlib.Path,
                   help="where a run's directory is made (default: <build>/scale_bench)")
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    p.add_argument("--quick", action="store_true", help="a narrower model (hidden 1024)")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--procs", default="1,2")
    p.add_argument("--moe-layers", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--dense-layers", type=int)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="sequences per process per step")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="compute threads of one process; at N processes each gets threads / N")
    p.add_argument("--packed-weight-gb", type=float, default=2,
                   help="experts.packed_weight_gb of the runs (and the plan's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout", type=int, default=900, help="seconds per moefit run")
    args = p.parse_args()
    s = Shape(**(QUICK if args.quick else {}))
    for field in ("moe_layers", "experts", "dense_layers"):
        if getattr(args, field) is not None:
            setattr(s, field, getattr(args, field))
    formats = [f for f in args.formats.split(",") if f]
    if bad := [f for f in formats if f not in FORMATS]:
        raise SystemExit(f"--formats: unknown {bad} (known: {', '.join(FORMATS)})")
    procs_list = [int(n) for n in args.procs.split(",")]
    if any(n < 1 or s.experts % n for n in procs_list):
        raise SystemExit(f"--procs: each count must divide the {s.experts} experts")
    args.moefit = args.build / "launch" / "moefit"
    if not args.moefit.is_file():
        raise SystemExit(f"{args.moefit} not found: cmake --build {args.build} --target moefit")
    args.ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    parent = args.work_dir or args.build / "scale_bench"
    parent.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="run-", dir=parent))
    started = time.perf_counter()
    try:
        run(args, s, formats, procs_list, work)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work)
    print(f"total {time.perf_counter() - started:.0f} s")


def run(args, s: Shape, formats, procs_list, work):
    print(f"kimi_k2 widths: hidden {s.hidden}, {s.moe_layers} MoE layers of {s.experts} experts of "
          f"{s.inter} (top-{s.top_k}, 1 shared), {s.dense_layers} dense layers; MLA q_lora "
          f"{s.q_lora}, kv_lora {s.kv_lora}, {s.heads} heads of {s.nope}+{s.rope} / {s.v_head}; "
          f"{s.expert_params() / 1e9:.2f}B expert parameters")
    print(f"CPU flags: {cpu_flags()}; {os.cpu_count()} cores, {args.ram_gib:.1f} GiB RAM")
    need = sum(math.prod(sh) * ELEMENT_BYTES[dt] for fmt in formats
               for t in tensors(s) for _, dt, sh in stored(*t, fmt))
    free = shutil.disk_usage(work).free
    if need > free * 0.95:
        raise SystemExit(f"{work}: the checkpoints need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    t = time.perf_counter()
    dirs = write_checkpoints(s, formats, work, args.seed)
    os.sync()
    print(f"wrote {need / 1e9:.1f} GB ({', '.join(formats)}) in {time.perf_counter() - t:.0f} s")

    threads = {n: max(1, args.threads // n) for n in procs_list}
    ceilings = {th: gemm_gflops(th) for th in sorted(set(threads.values()))}
    base = {n: fixed_cost(args, n, threads[n], work) for n in procs_list}
    print("float32 GEMM ceiling: " + ", ".join(f"{v:.1f} GFLOP/s on {k} thread(s)"
                                               for k, v in ceilings.items()) +
          "; a moefit process on the built-in tiny model: " +
          ", ".join(f"{base[n] / 2 ** 30:.2f} GiB at {n} process(es)" for n in procs_list))

    results, failed, isa = {}, {}, None
    for fmt in formats:
        files = checkpoint_files(dirs[fmt])
        total, seconds = cold_read_rate(files)
        rate = total / seconds
        print(f"{fmt}: {total / 1e9:.2f} GB in {len(files)} files, read cold at "
              f"{rate / 1e9:.2f} GB/s")
        for n in procs_list:
            drop_from_page_cache(files)
            metrics = work / f"{fmt}-np{n}.jsonl"
            extra = [f"model.model_path={dirs[fmt]}",
                     f"lora.target_modules=[{','.join(ATTENTION)},experts]",
                     f"experts.num_threads={threads[n]}"]
            if fmt == "int4":
                extra.append("experts.dtype=int4")
            rc, out = run_moefit(args, n, threads[n], lora_sets(args, metrics, extra),
                                 work / f"{fmt}-np{n}.log")
            if rc != 0:
                reason = [l for l in out.splitlines() if l.strip()][-1:] or ["(no output)"]
                failed[fmt, n] = f"moefit exit {rc}: {reason[0]}"
                print(f"  {n} process(es): could not run: {failed[fmt, n]}")
                continue
            r = parse_log(out)
            if "peak_rss" not in r or "load_s" not in r:
                raise SystemExit(f"moefit's log lacks the load or memory lines:\n{out[-3000:]}")
            isa = isa or r["isa"]
            r["gflops"], r["tok_s"], r["expert_share"] = expert_rate(metrics, s, n)
            r["ceiling"] = ceilings[threads[n]]
            r["seq_s"] = r["load_gb"] * 1e9 / rate
            r["plan"] = plan_prediction(args, dirs[fmt], fmt, n, plan_isa(r["isa"]), base[n])
            results[fmt, n] = r
            print(f"  {n} process(es): done ({r['peak_rss'] / 2 ** 30:.2f} GiB peak)")

    if isa:
        print(f"moefit's expert kernels: {isa} (CPU flags: "
              f"{next(iter(results.values()))['cpu_flags']})")
    print(f"\nLoRA rank {LORA_RANK} on {', '.join(ATTENTION)} and the routed experts; "
          f"{args.batch} x {args.seq_len} tokens per process and step, {args.steps} steps "
          f"(rates: median of the steps after the first)")
    head = (f"{'format':6} {'np':>2} {'peak RSS':>9} {'B/expert param':>15} {'plan':>8} "
            f"{'plan err':>8} {'load':>7} {'seq read':>8} {'load/seq':>8} {'tok/s':>7} "
            f"{'expert GFLOP/s':>14} {'of ceiling':>10} {'expert share':>12}")
    print(head)
    for (fmt, n), r in results.items():
        err = r["plan"] / r["peak_rss"] - 1
        print(f"{fmt:6} {n:2d} {r['peak_rss'] / 2 ** 30:5.2f} GiB "
              f"{r['tensor_bytes_per_param']:6.3f}+{r['bytes_per_param'] - r['tensor_bytes_per_param']:.3f} "
              f"{r['plan'] / 2 ** 30:4.2f} GiB {err:+8.1%} {r['load_s']:6.1f}s {r['seq_s']:7.1f}s "
              f"{r['load_s'] / r['seq_s'] if r['seq_s'] > 0 else math.nan:8.2f} "
              f"{r['tok_s']:7.0f} {r['gflops']:14.1f} "
              f"{r['gflops'] / r['ceiling']:10.2f} {r['expert_share']:12.2f}")
    print("B/expert param: the routed experts' tensors + the kernels' kept packs, per expert "
          "parameter of the process; load: rank 0's bytes as moefit reports them; seq read: "
          "the same bytes at the cold sequential rate; expert share: expert_s / step_s")
    for (fmt, n), why in failed.items():
        print(f"{fmt} at {n} process(es) could not run: {why}")

    kernels, note = kernel_times(args, s)
    if kernels:
        print(f"\none core, forward + dX of one expert ({note.split(';')[0]}), ms per call / "
              "packed ahead:")
        for rows in GOAL_KERNEL_ROWS:
            fp8, int4 = kernels.get(("fp8", rows)), kernels.get(("int4", rows))
            if fp8 and int4:
                print(f"  {rows:4d} rows: fp8 {fp8[0]:8.2f} / {fp8[1]:8.2f}, int4 {int4[0]:8.2f} / "
                      f"{int4[1]:8.2f}; int4/fp8 {int4[0] / fp8[0]:.2f} / {int4[1] / fp8[1]:.2f}")
    else:
        print(f"\nkernel comparison not run: {note}")

    print("\ngoals:")
    for fmt, limit in GOAL_BYTES.items():
        got = [(n, r) for (f, n), r in results.items() if f == fmt]
        if not got:
            print(f"  {fmt} at most {limit} B per expert parameter: not measured ({fmt} did not run)")
            continue
        ok = all(r["bytes_per_param"] <= limit for _, r in got)
        print(f"  {fmt} at most {limit} B per expert parameter held: {'met' if ok else 'NOT met'} (" +
              ", ".join(f"{r['bytes_per_param']:.3f} at {n} process(es), of which the tensors "
                        f"{r['tensor_bytes_per_param']:.3f}" for n, r in got) +
              f"; the rest: the kernels' kept packs, experts.packed_weight_gb = "
              f"{args.packed_weight_gb:g})")
    if results:
        errs = {k: r["plan"] / r["peak_rss"] - 1 for k, r in results.items()}
        ok = all(abs(e) <= GOAL_PLAN_ERROR for e in errs.values())
        print(f"  plan within {GOAL_PLAN_ERROR:.0%} of the measured peak: "
              f"{'met' if ok else 'NOT met'} (" +
              ", ".join(f"{f} np{n} {e:+.1%}" for (f, n), e in errs.items()) + ")")
    if kernels and all(("fp8", r) in kernels and ("int4", r) in kernels for r in GOAL_KERNEL_ROWS):
        ok = all(kernels["int4", r][i] <= kernels["fp8", r][i]
                 for r in GOAL_KERNEL_ROWS for i in (0, 1))
        print(f"  int4 forward + dX at least as fast as FP8 at {GOAL_KERNEL_ROWS[0]}+ rows per "
              f"expert: {'met' if ok else 'NOT met'} (" + ", ".join(
                  f"{r} rows {kernels['int4', r][0] / kernels['fp8', r][0]:.2f}x / "
                  f"{kernels['int4', r][1] / kernels['fp8', r][1]:.2f}x FP8's time"
                  for r in GOAL_KERNEL_ROWS) + ")")
    else:
        print("  int4 forward + dX against FP8: not measured")
    if failed:
        print("  formats that could not run: " +
              "; ".join(f"{f} np{n}: {why}" for (f, n), why in failed.items()))
    # A smoke run fails when a format that should run did not.
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
