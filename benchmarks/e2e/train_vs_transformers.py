"""End-to-end training throughput: `moefit train` against Hugging Face
transformers training the same model on the same cores.

For a family (qwen3_moe, deepseek_v3, glm4_moe), a model is built by
transformers with random weights and saved; then the same number of steps of
AdamW on batches of the same shape runs in both (transformers in eager PyTorch
with its grouped_mm experts, one process; moefit with `model.model_path` of the
saved directory, one process), each with the same thread count. Prints tokens
per second of each (steps after the first two, which warm up allocators), the
ratio moefit / transformers, and each one's model FLOPs per second against a
float32 GEMM ceiling (torch.mm of 2048^3 on the same threads) measured in the
same run. The three are measured in --rounds interleaved rounds (moefit first
in one round, transformers first in the next), each round printed; the summary
takes the best round of each, since a shared machine's noise only ever slows a
run down. Model FLOPs per token: 6 x the parameters a token passes through
(2 forward, 4 backward; the routed experts counted top_k times, embeddings
not) plus attention's 12 x layers x seq_len x heads x head dim; in LoRA mode
the frozen weights take no weight gradient, so 4 x (and the adapters' FLOPs
are left out).

--mode lora trains rank-16 LoRA adapters on the attention projections and on
the fused experts (PEFT's target_parameters for transformers + PEFT; moefit's
lora.target_modules with `experts`), the base frozen. --experts-dtype sets
moefit's experts.dtype. transformers trains in float32; in --mode lora with
bfloat16 experts it is also timed with its whole frozen base in bfloat16 (the
like-for-like run, as a bfloat16 checkpoint loads), and the summary gives the
ratio against each and against the faster of the two.

    ~/.cache/moefit/venv/bin/python benchmarks/e2e/train_vs_transformers.py \\
        --family qwen3_moe [--mode full|lora --hidden 512 --experts 32 --layers 4 --steps 8 --threads 2 \\
        --rounds 2]

Defaults finish in about two minutes on 2 cores.
"""
import argparse
import copy
import os
import pathlib
import re
import subprocess
import tempfile
import time

import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig, Qwen3MoeConfig)


def config(args):
    h, e, inter = args.hidden, args.experts, args.inter
    common = dict(vocab_size=256, hidden_size=h, num_hidden_layers=args.layers, num_attention_heads=8,
                  max_position_embeddings=4096, num_experts_per_tok=args.top_k,
                  moe_intermediate_size=inter, intermediate_size=4 * inter)
    if args.family == "qwen3_moe":
        return Qwen3MoeConfig(**common, num_key_value_heads=4, head_dim=h // 8, num_experts=e,
                              norm_topk_prob=True, router_aux_loss_coef=0.0)
    if args.family == "deepseek_v3":
        return DeepseekV3Config(**common, q_lora_rank=h // 2, kv_lora_rank=h // 4,
                                qk_nope_head_dim=h // 16, qk_rope_head_dim=h // 32,
                                v_head_dim=h // 16, n_routed_experts=e, n_shared_experts=1,
                                first_k_dense_replace=1, n_group=4, topk_group=2)
    return Glm4MoeConfig(**common, num_key_value_heads=4, head_dim=h // 8, n_routed_experts=e,
                         n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True,
                         attention_bias=True)


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def lora_targets(args):
    return MLA if args.family == "deepseek_v3" else ATTENTION


def transformers_tok_s(model, args):
    torch.set_num_threads(args.threads)
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, target_modules=lora_targets(args),
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.steps):
        ids = torch.randint(0, 256, (args.batch, args.seq_len), generator=gen)
        start = time.perf_counter()
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return args.batch * args.seq_len / (sum(times[2:]) / len(times[2:]))


def moefit_tok_s(build_dir, model_dir, args):
    cmd = [str(build_dir / "launch" / "moefit"), "train", "--set", f"model.model_path={model_dir}",
           "--set", f"train.steps={args.steps}", "--set", f"train.seq_len={args.seq_len}",
           "--set", f"train.micro_batch_size={args.batch}", "--set", "logging.metrics_file=",
           "--set", "schedule.warmup_steps=0", "--set", "optimizer.lr=1e-4",
           "--set", f"experts.dtype={args.experts_dtype}"]
    if args.mode == "lora":
        targets = ",".join(lora_targets(args) + ["experts"])
        cmd += ["--set", "train.mode=lora", "--set", f"lora.rank={args.rank}",
                "--set", f"lora.alpha={2 * args.rank}", "--set", f"lora.target_modules=[{targets}]"]
    env = dict(os.environ, MOEFIT_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    rates = [float(m) for m in re.findall(r"\| (\d+) tok/s", out)]
    return sum(rates[2:]) / len(rates[2:])


def gemm_gflops(threads):
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 2.0:
        torch.mm(a, b)
        n += 1
    return 2 * 2048 ** 3 * n / (time.perf_counter() - start) / 1e9


def flops_per_token(model, cfg, args):
    """Model FLOPs of one trained token (see the top of the file)."""
    routed = shared = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        if ".mlp.experts." in name:
            routed += p.numel()
        else:
            shared += p.numel()
    active = shared + routed * cfg.num_experts_per_tok / args.experts
    heads_dim = cfg.num_attention_heads * getattr(cfg, "head_dim", None) if getattr(
        cfg, "head_dim", None) else cfg.hidden_size
    attention = 12 * cfg.num_hidden_layers * args.seq_len * heads_dim / 2  # causal: half
    per_param = 6 if args.mode == "full" else 4
    return per_param * active + (attention if args.mode == "full" else 2 * attention / 3)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "deepseek_v3", "glm4_moe"])
    p.add_argument("--mode", default="full", choices=["full", "lora"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--experts-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--build-dir", default=os.environ.get("MOEFIT_BUILD_DIR", "build"))
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = config(args)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm")
    fpt = flops_per_token(model, cfg, args)
    n = sum(p.numel() for p in model.parameters())
    hf_name = "transformers" + (" + PEFT" if args.mode == "lora" else "")
    print(f"{args.family}, {args.mode}: {n / 1e6:.1f}M parameters, {args.layers} layers, hidden "
          f"{args.hidden}, {args.experts} experts of {args.inter} top-{args.top_k}, {args.batch} x "
          f"{args.seq_len} tokens per step, {args.threads} threads; moefit experts in "
          f"{args.experts_dtype}; model FLOPs per token {fpt / 1e6:.1f} M", flush=True)
    # transformers' runs: float32, and in LoRA with bfloat16 experts a bfloat16 base too
    hf_dtypes = [torch.float32]
    if args.mode == "lora" and args.experts_dtype == "bfloat16":
        hf_dtypes.append(torch.bfloat16)
    ceilings, mfs, hfs = [], [], {d: [] for d in hf_dtypes}
    label = {torch.float32: hf_name, torch.bfloat16: hf_name + " (bfloat16 base)"}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for r in range(args.rounds):
            ceilings.append(gemm_gflops(args.threads))
            # transformers trains a copy, so that every round starts from the same weights
            runs = [lambda: mfs.append(moefit_tok_s(pathlib.Path(args.build_dir), tmp, args))]
            runs += [lambda d=d: hfs[d].append(transformers_tok_s(copy.deepcopy(model).to(d), args))
                     for d in hf_dtypes]
            for run in runs if r % 2 == 0 else reversed(runs):
                run()
            print(f"  round {r + 1}: ceiling {ceilings[-1]:6.1f} GFLOP/s, " +
                  ", ".join(f"{label[d]} {hfs[d][-1]:6.0f} tokens/s" for d in hf_dtypes) +
                  f", moefit {mfs[-1]:6.0f} tokens/s, ratio " +
                  " / ".join(f"{mfs[-1] / hfs[d][-1]:.2f}" for d in hf_dtypes), flush=True)
    ceiling, mf = max(ceilings), max(mfs)
    best = {d: max(hfs[d]) for d in hf_dtypes}
    print(f"  best of {args.rounds} rounds; float32 GEMM ceiling: {ceiling:8.1f} GFLOP/s")
    for name, tok in [(label[d], best[d]) for d in hf_dtypes] + [("moefit", mf)]:
        gf = tok * fpt / 1e9
        print(f"  {name:36s} {tok:8.0f} tokens/s  {gf:7.1f} GFLOP/s  {gf / ceiling:5.2f} of the ceiling")
    for d in hf_dtypes:
        print(f"  ratio moefit / {label[d]} = {mf / best[d]:.2f}")
    if len(hf_dtypes) > 1:
        print(f"  ratio moefit / the faster transformers run = {mf / max(best.values()):.2f}")


if __name__ == "__main__":
    main()
