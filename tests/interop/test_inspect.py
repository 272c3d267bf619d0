"""`moefit inspect` on model directories written by transformers' save_pretrained."""
import re
import subprocess

import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM


def test_inspect_counts_match_transformers(build_dir, tmp_path):
    config = Qwen2MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                            moe_intermediate_size=32, shared_expert_intermediate_size=48,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                            num_experts=12, num_experts_per_tok=3, mlp_only_layers=[2])
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="300KB")
    out = subprocess.run([str(build_dir / "launch/moefit"), "inspect", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - expert + expert * 3 / 12
    m = re.search(r"parameters: ([0-9.]+)K total .*, ([0-9.]+)K active per token", out.stdout)
    assert m, out.stdout
    assert abs(float(m.group(1)) * 1e3 - total) < 100
    assert abs(float(m.group(2)) * 1e3 - active) < 100
    assert "dense MLP in layers [2]" in out.stdout
    assert "experts stored one tensor per expert; shared expert" in out.stdout
    assert re.search(r"model\.layers\.\*\.mlp\.experts\.\*\.gate_proj\.weight +x24 +F32 +\[32, 64\]",
                     out.stdout), out.stdout


def test_inspect_missing_path(build_dir, tmp_path):
    out = subprocess.run([str(build_dir / "launch/moefit"), "inspect", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "no such file or directory" in out.stderr
