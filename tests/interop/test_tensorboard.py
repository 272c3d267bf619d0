"""moefit's TensorBoard event files, read by TensorBoard's own reader.

`moefit train` runs a few steps of a small model with logging.metrics_file
and logging.tensorboard_dir; the `tensorboard` package's EventAccumulator
(the reader behind `tensorboard --logdir`, every event kept) must read back
every scalar and histogram with the values of the same step's line of the
metrics file: the loss, lr, grad norm, tokens/s, time split and memory, and
each MoE layer's routing telemetry; its tokens per expert and decayed
counters as histograms whose counts, sums, extremes and buckets are those of
the logged values. A softmax-routed model (qwen3_moe) and a sigmoid-routed
one with correction biases (deepseek_v3).

TensorBoard stores scalars as float32: values are compared to float32
rounding. The event files' CRCs are checked by the reader itself (a bad CRC
is an error there, not a skip).
"""
import json
import math
import pathlib
import subprocess

import pytest

ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

SMALL = ["train.steps=5", "train.seq_len=32", "train.micro_batch_size=4", "model.hidden_size=64",
         "model.head_dim=16", "model.moe_intermediate_size=32", "schedule.warmup_steps=1",
         "logging.routing_half_life_steps=3"]
DEEPSEEK = ["model.model_type=deepseek_v3", "model.router_aux_loss_coef=0", "model.q_lora_rank=24",
            "model.kv_lora_rank=16", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
            "model.v_head_dim=16", "model.n_group=4", "model.topk_group=2",
            "model.first_k_dense_replace=1", "model.num_hidden_layers=3",
            "model.aux_loss_alpha=0.01", "router.bias_update_rate=0.01"]
GIB = 1024.0 ** 3


def train(build_dir, run_dir, sets):
    moefit = build_dir / "launch" / "moefit"
    args = [str(moefit), "train", "--set", f"logging.metrics_file={run_dir / 'metrics.jsonl'}",
            "--set", f"logging.tensorboard_dir={run_dir / 'tb'}"]
    for s in SMALL + sets:
        args += ["--set", s]
    env = {"OMP_NUM_THREADS": "1", "MOEFIT_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    acc = ea.EventAccumulator(str(run_dir / "tb"), size_guidance={
        ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.IMAGES: 0})
    acc.Reload()
    return lines, acc


def f32_close(got, want):
    return math.isclose(got, want, rel_tol=2e-7, abs_tol=1e-30)


def expected_scalars(line):
    """tag -> value, as moefit's metrics line gives them."""
    s = {"train/loss": line["loss"], "train/aux_loss": line["aux_loss"], "train/lr": line["lr"],
         "train/grad_norm": line["grad_norm"], "train/tokens_per_s": line["tokens_per_s"],
         "time/step_s": line["step_s"], "time/expert_s": line["expert_s"],
         "time/comm_s": line["comm_s"], "time/optimizer_s": line["optimizer_s"],
         "memory/host_rss_gib": int(line["host_rss_bytes"]) / GIB,
         "memory/host_peak_gib": int(line["host_peak_bytes"]) / GIB}
    layers = line["moe_layers"]
    for l in layers:
        n = f"layer_{l['layer']:02d}"
        s[f"load_max_over_mean/{n}"] = l["max_over_mean"]
        s[f"load_cv/{n}"] = l["cv"]
        s[f"router_entropy/{n}"] = l["router_entropy"]
        if "balance_loss" in l:
            s[f"balance_loss/{n}"] = l["balance_loss"]
        if "correction_bias" in l:
            b = l["correction_bias"]
            s[f"bias_std/{n}"] = b["std"]
            s[f"bias_range/{n}"] = b["max"] - b["min"]
    s["routing/max_over_mean_max"] = max(l["max_over_mean"] for l in layers)
    s["routing/cv_mean"] = sum(l["cv"] for l in layers) / len(layers)
    s["routing/entropy_mean"] = sum(l["router_entropy"] for l in layers) / len(layers)
    return s


def check_histogram(h, values, rel=0.0):
    """A HistogramValue against the values it must summarize (moefit's buckets: equal widths
    between min and max, bucket i holding (limit[i-1], limit[i]])."""
    assert h.num == len(values)
    assert math.isclose(h.min, min(values), rel_tol=rel)
    assert math.isclose(h.max, max(values), rel_tol=rel)
    assert math.isclose(h.sum, sum(values), rel_tol=max(rel, 1e-12))
    assert math.isclose(h.sum_squares, sum(v * v for v in values), rel_tol=max(rel, 1e-12))
    assert sum(h.bucket) == len(values)
    assert h.bucket_limit[-1] == h.max
    if rel == 0.0:  # exact values: every value in its bucket
        limits = list(h.bucket_limit)
        counts = [0] * len(limits)
        for v in values:
            i = next(i for i, lim in enumerate(limits) if v <= lim)
            counts[i] += 1
        assert counts == list(h.bucket)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_every_scalar_and_histogram_reads_back(build_dir, tmp_path, family):
    lines, acc = train(build_dir, tmp_path, ["model.num_hidden_layers=2"] if family == "qwen3_moe"
                       else DEEPSEEK)
    assert len(lines) == 5
    tags = acc.Tags()
    wanted = {}
    for line in lines:
        for tag, v in expected_scalars(line).items():
            wanted.setdefault(tag, {})[line["step"]] = v
    # Exactly the tags moefit writes, each at every step, with its value.
    assert set(tags["scalars"]) == set(wanted)
    if family == "deepseek_v3":
        assert "bias_std/layer_01" in wanted and "balance_loss/layer_02" in wanted
    for tag, by_step in wanted.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == sorted(by_step), tag
        for e in events:
            assert f32_close(e.value, by_step[e.step]), (tag, e.step, e.value, by_step[e.step])
    for line in lines:
        for l in line["moe_layers"]:
            n = f"layer_{l['layer']:02d}"
            load = next(h for h in acc.Histograms(f"expert_load/{n}") if h.step == line["step"])
            check_histogram(load.histogram_value, l["tokens_per_expert"])
            decayed = next(h for h in acc.Histograms(f"expert_load_decayed/{n}")
                           if h.step == line["step"])
            # The metrics file holds float32 counters, the histogram their float64 sums.
            check_histogram(decayed.histogram_value, l["decayed_load"], rel=1e-6)
    assert len(tags["histograms"]) == 2 * len(lines[0]["moe_layers"])


def test_expert_map_images_files_and_redraw(build_dir, tmp_path):
    """The expert map every 2 steps and after the last (step 5): PNG files beside the metrics
    file, the same bytes as TensorBoard's "expert_map" images, readable by Pillow at the
    stated size; `moefit expert-map` draws each again from the metrics file, byte for byte."""
    from PIL import Image
    lines, acc = train(build_dir, tmp_path, ["model.num_hidden_layers=3",
                                             "logging.expert_map_every_steps=2"])
    images = acc.Images("expert_map")
    assert [i.step for i in images] == [2, 4, 5]
    for i in images:
        f = tmp_path / f"expert-map-step-{i.step:08d}.png"
        assert f.read_bytes() == i.encoded_image_string
        with Image.open(f) as im:
            assert im.format == "PNG" and im.mode == "RGB"
            assert im.size == (i.width, i.height)
            # 3 MoE layers x 8 experts, cells of 24 x 24 px at this size.
            assert im.size == (8 * 24, 3 * 24)
    assert (tmp_path / "expert-map.png").read_bytes() == images[-1].encoded_image_string
    moefit = str(build_dir / "launch" / "moefit")
    for step, want in [(0, images[-1]), (4, images[1]), (2, images[0])]:
        out = tmp_path / f"redraw-{step}.png"
        r = subprocess.run([moefit, "expert-map", str(tmp_path), "--step", str(step), "--out",
                            str(out)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert out.read_bytes() == want.encoded_image_string, step
