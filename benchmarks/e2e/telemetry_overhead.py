"""What routing telemetry, TensorBoard and the expert map cost a training step.

`moefit train` at the end-to-end benchmark's shape (train_vs_transformers.py's
defaults: qwen3_moe, hidden 512, 32 experts of intermediate 256, top-4, 4
layers, 8 sequences of 256 tokens, random weights) runs twice per round:
"off" (logging.routing_telemetry=false, no TensorBoard, no expert map; the
metrics file as always) and "on" (telemetry, logging.tensorboard_dir, and the
expert map every step, the most it can be asked for). The step time is
rank 0's wall clock of each step (step_s in the metrics file, which includes
the telemetry's sums and figures), taken as the median over the steps after
the first two; the TensorBoard event and the map are written after step_s is
taken, so the wall clock of the whole run is reported too, per step. Rounds
alternate which run goes first; the summary takes the best round of each
(a shared machine's noise only ever slows a run down).

    ~/.cache/moefit/venv/bin/python benchmarks/e2e/telemetry_overhead.py \\
        [--steps 12 --rounds 3 --threads 2 --build-dir build]
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import tempfile
import time


def run(build_dir, work, args, on):
    metrics = work / ("on.jsonl" if on else "off.jsonl")
    cmd = [str(build_dir / "launch" / "moefit"), "train",
           "--set", "model.hidden_size=512", "--set", "model.moe_intermediate_size=256",
           "--set", "model.intermediate_size=1024", "--set", "model.num_experts=32",
           "--set", "model.num_experts_per_tok=4", "--set", "model.num_hidden_layers=4",
           "--set", "model.num_attention_heads=8", "--set", "model.num_key_value_heads=4",
           "--set", "model.head_dim=64", "--set", "train.seq_len=256",
           "--set", "train.micro_batch_size=8", "--set", f"train.steps={args.steps}",
           "--set", "schedule.warmup_steps=0", "--set", "parallel.device=cpu",
           "--set", f"logging.metrics_file={metrics}"]
    if on:
        cmd += ["--set", f"logging.tensorboard_dir={work / 'tb'}",
                "--set", "logging.expert_map_every_steps=1"]
    else:
        cmd += ["--set", "logging.routing_telemetry=false"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MOEFIT_NUM_THREADS=str(args.threads))
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(r.stdout + r.stderr)
    steps = [json.loads(l)["step_s"] for l in metrics.read_text().splitlines()][2:]
    return statistics.median(steps), wall


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--build-dir", default=os.environ.get("MOEFIT_BUILD_DIR", "build"))
    args = p.parse_args()
    build_dir = pathlib.Path(args.build_dir)
    best = {False: (1e9, 1e9), True: (1e9, 1e9)}
    for r in range(args.rounds):
        for on in ([False, True] if r % 2 == 0 else [True, False]):
            with tempfile.TemporaryDirectory() as d:
                step, wall = run(build_dir, pathlib.Path(d), args, on)
            print(f"round {r + 1}: {'on ' if on else 'off'}: median step {step * 1e3:.1f} ms, "
                  f"run {wall:.2f} s", flush=True)
            best[on] = (min(best[on][0], step), min(best[on][1], wall))
    (off_step, off_wall), (on_step, on_wall) = best[False], best[True]
    print(f"best: step {off_step * 1e3:.1f} ms off, {on_step * 1e3:.1f} ms on: "
          f"{(on_step / off_step - 1) * 100:+.2f}%; whole run {off_wall:.2f} s off, "
          f"{on_wall:.2f} s on: {(on_wall - off_wall) / args.steps * 1e3:+.1f} ms per step "
          f"({(on_wall - off_wall) / args.steps / off_step * 100:+.2f}% of a step)")


if __name__ == "__main__":
    main()
