"""Memory and step time of fine-tuning one model four ways, in one run:
full fine-tuning with float32 experts, full fine-tuning with bfloat16 experts,
LoRA on a frozen bfloat16 base (rank 8 on attention and every routed expert),
and the same LoRA on the model's FP8 checkpoint, whose experts stay FP8.

qwen3_moe models whose routed experts are most of their parameters are built
by transformers with random weights and saved in bfloat16, and once more with
their routed experts quantized to FP8 e4m3 in 128 x 128 blocks (as published
FP8 checkpoints are), at two expert counts
(--experts and half of it); `moefit train` starts from each in each mode (one
process, the same batches). Reported per mode: the peak RSS of the run on the
larger model (wait4's rusage of that child alone), and the bytes of peak RSS per
routed-expert parameter the process holds, measured as the slope between the
two sizes: (peak(E) - peak(E/2)) / (expert params(E) - expert params(E/2)).
The slope leaves out what does not grow with the experts (LibTorch, the data,
activations of the same token count), which a rank holding billions of expert
parameters no longer notices. Also the median step time after the first step,
as a ratio to the full float32 step of the same run.

The models are written by a separate Python process, so that this one stays
small: a child's peak RSS counts the memory of the process it was forked from.

    ~/.cache/moefit/venv/bin/python benchmarks/e2e/lora_memory_bench.py \\
        [--hidden 1024 --inter 512 --experts 32 --layers 4 --rank 8 --steps 3 --threads 2]

Defaults finish in about two minutes on 2 cores; the CPU's flags are printed
with the numbers (bfloat16 expert compute is only fast where the CPU has
AVX-512 BF16 or AMX).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile



def cpu_flags():
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]
    return " ".join(f for f in wanted if f in flags) or "none of " + " ".join(wanted)


def run_moefit(moefit, args, sets, tmp):
    """Runs one `moefit train`; returns its own peak RSS (wait4's rusage of that
    child alone) and the median step time after the first step."""
    metrics = tmp / "metrics.jsonl"
    cmd = [str(moefit), "train", "--set", f"logging.metrics_file={metrics}", *sum(
        (["--set", s] for s in sets), [])]
    env = dict(os.environ, MOEFIT_NUM_THREADS=str(args.threads))
    with open(tmp / "log.txt", "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"moefit failed ({' '.join(cmd)}):\n{(tmp / 'log.txt').read_text()}")
    steps = [json.loads(line)["step_s"] for line in metrics.read_text().splitlines()]
    return usage.ru_maxrss * 1024, statistics.median(steps[1:]) if len(steps) > 1 else steps[0]


def quantize_fp8(w, block=128):
    """[rows, cols] -> (e4m3 weight, fp32 scale per block = amax / 448)."""
    import torch
    rows, cols = w.shape
    r, c = -(-rows // block), -(-cols // block)
    padded = torch.nn.functional.pad(w.float(), (0, c * block - cols, 0, r * block - rows))
    amax = padded.view(r, block, c, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def make_model(args, out):
    """In its own process: the bf16 checkpoint, and beside it (out + "_fp8")
    the same with FP8 routed experts; prints the parameter count."""
    import json
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
                         moe_intermediate_size=args.inter, intermediate_size=4 * args.inter,
                         num_experts=args.experts, num_experts_per_tok=args.top_k,
                         norm_topk_prob=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    fp8 = pathlib.Path(out + "_fp8")
    fp8.mkdir()
    tensors = {}
    for name, t in model.state_dict().items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name] = t.contiguous()
            continue
        prefix = name.rsplit(".", 1)[0]
        for e in range(t.shape[0]):
            parts = ({"gate_proj": t[e, :args.inter], "up_proj": t[e, args.inter:]}
                     if name.endswith("gate_up_proj") else {"down_proj": t[e]})
            for proj, w in parts.items():
                key = f"{prefix}.{e}.{proj}.weight"
                tensors[key], tensors[key + "_scale_inv"] = quantize_fp8(w)
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((pathlib.Path(out) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(config))
    print(sum(t.numel() for t in model.parameters()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default=os.environ.get("MOEFIT_BUILD_DIR", "build"))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--make-model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make_model:
        make_model(args, args.make_model)
        return
    moefit = pathlib.Path(args.build) / "launch" / "moefit"

    def expert_params(experts):
        return args.layers * experts * 3 * args.hidden * args.inter

    sizes = [args.experts // 2, args.experts]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        totals = {}
        for e in sizes:
            made = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--experts", str(e),
                                   "--make-model", str(tmp / f"hf{e}")],
                                  capture_output=True, text=True, check=True)
            totals[e] = int(made.stdout.split()[-1])
        lora = ["train.mode=lora", f"lora.rank={args.rank}", "lora.alpha=32",
                "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,experts]"]
        modes = [
            ("LoRA r%d, fp8 experts" % args.rank, lora, "_fp8"),
            ("LoRA r%d, bf16 base" % args.rank, lora, ""),
            ("full, bf16 experts", ["experts.dtype=bfloat16"], ""),
            ("full, fp32 experts", ["experts.dtype=float32"], ""),
        ]
        print(f"qwen3_moe: hidden {args.hidden}, {args.layers} layers, {args.experts} experts of "
              f"{args.inter} (top-{args.top_k}): {totals[args.experts] / 1e6:.1f}M parameters, "
              f"{expert_params(args.experts) / 1e6:.1f}M in routed experts (and half the experts "
              f"for the slope); {args.batch} x {args.seq_len} tokens per step, {args.threads} "
              f"threads; CPU flags: {cpu_flags()}")
        results = {}
        for name, sets, suffix in modes:
            for e in sizes:
                common = [f"model.model_path={tmp / f'hf{e}{suffix}'}", f"train.steps={args.steps}",
                          f"train.micro_batch_size={args.batch}", f"train.seq_len={args.seq_len}",
                          "optimizer.lr=1e-4", "schedule.warmup_steps=0"]
                results[name, e] = run_moefit(moefit, args, common + sets, tmp)
        full_step = results["full, fp32 experts", args.experts][1]
        print(f"{'mode':24} {'peak RSS':>10} {'B/expert param (slope)':>23} {'step s':>8} "
              f"{'step / full fp32':>17}")
        for name, *_ in modes:
            (small, _), (big, step) = results[name, sizes[0]], results[name, sizes[1]]
            slope = (big - small) / (expert_params(sizes[1]) - expert_params(sizes[0]))
            print(f"{name:24} {big / 2**30:6.2f} GiB {slope:23.2f} {step:8.2f} "
                  f"{step / full_step:17.2f}")
        # What the slope must hold in LoRA mode: the bf16 weights, and each
        # expert's adapters (gate|up: r(H + 2I), down: r(I + H)) with their
        # gradients and AdamW m, v in fp32.
        h, i, r = args.hidden, args.inter, args.rank
        adapters = 16 * r * (2 * h + 3 * i) / (3 * h * i)
        print(f"LoRA floor: 2.00 B (bf16 weights; fp8: 1.00 B) + {adapters:.2f} B (adapter, "
              f"gradient, m, v) = {2 + adapters:.2f} B (fp8: {1 + adapters:.2f} B) per expert "
              f"parameter; the expert kernels also keep packs of frozen weights (float32, "
              f"bfloat16 pairs, or FP8 bytes where the kernels multiply pairs; up to 2 GiB per "
              f"process), and the slope holds allocator growth, which "
              f"varies from run to run by a few tenths")

if __name__ == "__main__":
    main()
