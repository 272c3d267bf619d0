"""Do the dense layers' threads and the experts' get in each other's way?

moefit runs the dense layers on LibTorch's intra-op threads (GNU OpenMP from
the torch wheel) and, by default, the expert layers' tiles on the same
threads. OpenMP's threads spin for a while after each parallel region before
they sleep; with the experts on a oneTBB arena of their own
(experts.thread_pool onetbb), the arena's workers share the cores with those
spinning threads. This runs the same `moefit train` (qwen3_moe, the shape of
train_vs_transformers.py) with OpenMP's wait policy left alone, forced passive
(sleep at once) and forced active (spin), with the experts on oneTBB, and with
the experts one thread short of the process's count, and prints tokens/s of
each as a ratio to the default, measured in the same run.

    ~/.cache/moefit/venv/bin/python benchmarks/e2e/thread_budget.py [--threads 2 --mode full|lora]
"""
import argparse
import os
import pathlib
import re
import subprocess
import tempfile

import torch
from transformers import AutoModelForCausalLM

import train_vs_transformers as tvt


def tok_s(build_dir, model_dir, args, env_extra, sets):
    cmd = [str(build_dir / "launch" / "moefit"), "train", "--set", f"model.model_path={model_dir}",
           "--set", f"train.steps={args.steps}", "--set", f"train.seq_len={args.seq_len}",
           "--set", f"train.micro_batch_size={args.batch}", "--set", "logging.metrics_file=",
           "--set", "schedule.warmup_steps=0", "--set", "optimizer.lr=1e-4"]
    if args.mode == "lora":
        cmd += ["--set", "train.mode=lora", "--set", "lora.rank=16",
                "--set", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,experts]"]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(MOEFIT_NUM_THREADS=str(args.threads), **env_extra)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    rates = [float(m) for m in re.findall(r"\| (\d+) tok/s", out)]
    return sum(rates[2:]) / len(rates[2:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="full", choices=["full", "lora"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--build-dir", default=os.environ.get("MOEFIT_BUILD_DIR", "build"))
    args = p.parse_args()
    shape = argparse.Namespace(family="qwen3_moe", hidden=512, inter=256, experts=32, top_k=4,
                               layers=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tvt.config(shape))
    variants = [
        ("default (OpenMP wait policy unset)", {}, []),
        ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}, []),
        ("OMP_WAIT_POLICY=ACTIVE", {"OMP_WAIT_POLICY": "ACTIVE"}, []),
        ("experts.thread_pool=onetbb", {}, ["experts.thread_pool=onetbb"]),
    ]
    if args.threads > 1:
        variants.append((f"experts.num_threads={args.threads - 1}", {},
                         [f"experts.num_threads={args.threads - 1}"]))
    results = {name: [] for name, _, _ in variants}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        # Interleaved rounds, so that a slow patch of a shared machine hits
        # every variant alike.
        for _ in range(args.rounds):
            for name, env, sets in variants:
                results[name].append(tok_s(pathlib.Path(args.build_dir), tmp, args, env, sets))
    print(f"moefit train ({args.mode}), qwen3_moe hidden 512, 32 experts, {args.batch} x "
          f"{args.seq_len} tokens, {args.threads} threads; best of {args.rounds} interleaved rounds")
    for name, _, _ in variants:
        best = max(results[name])
        print(f"  {name:40s} {best:8.0f} tokens/s  {best / max(results[variants[0][0]]):5.2f}x")


if __name__ == "__main__":
    main()
