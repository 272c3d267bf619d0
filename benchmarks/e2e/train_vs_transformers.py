"""End-to-end training throughput: `moefit train` against Hugging Face
transformers training the same model on the same cores.

For a family (qwen3_moe, deepseek_v3, glm4_moe), a model is built by
transformers with random weights and saved; then the same number of steps of
AdamW on batches of the same shape runs in both (transformers in eager PyTorch
with its grouped_mm experts, one process; moefit with `model.model_path` of the
saved directory, one process), each with the same thread count. Prints tokens
per second of each (steps after the first two, which warm up allocators) and
the ratio moefit / transformers, measured in this run.

    ~/.cache/moefit/venv/bin/python benchmarks/e2e/train_vs_transformers.py \\
        --family deepseek_v3 [--hidden 512 --experts 32 --layers 4 --steps 8 --threads 2]

Defaults finish in well under two minutes on 2 cores.
"""
import argparse
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


def transformers_tok_s(model, args):
    torch.set_num_threads(args.threads)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
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
           "--set", "schedule.warmup_steps=0", "--set", "optimizer.lr=1e-4"]
    env = dict(os.environ, MOEFIT_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    rates = [float(m) for m in re.findall(r"\| (\d+) tok/s", out)]
    return sum(rates[2:]) / len(rates[2:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="deepseek_v3", choices=["qwen3_moe", "deepseek_v3", "glm4_moe"])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--build-dir", default=os.environ.get("MOEFIT_BUILD_DIR", "build"))
    args = p.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(args), experts_implementation="grouped_mm")
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        hf = transformers_tok_s(model, args)
        mf = moefit_tok_s(pathlib.Path(args.build_dir), tmp, args)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.family}: {n / 1e6:.1f}M parameters, {args.layers} layers, hidden {args.hidden}, "
          f"{args.experts} experts top-{args.top_k}, {args.batch} x {args.seq_len} tokens per step, "
          f"{args.threads} threads")
    print(f"  transformers: {hf:8.0f} tokens/s")
    print(f"  moefit:       {mf:8.0f} tokens/s   ratio moefit / transformers = {mf / hf:.2f}")


if __name__ == "__main__":
    main()
