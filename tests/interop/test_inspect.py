"""`moefit inspect` on model directories written by transformers' save_pretrained."""
import json
import math
import re
import subprocess

import torch
from safetensors.torch import load_file, save_file
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM)


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


def inspect_counts(build_dir, path):
    out = subprocess.run([str(build_dir / "launch/moefit"), "inspect", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    m = re.search(r"parameters: ([0-9.]+)K total .*, ([0-9.]+)K active per token", out.stdout)
    assert m, out.stdout
    return float(m.group(1)) * 1e3, float(m.group(2)) * 1e3, out.stdout


def to_block_fp8(weight, block=128):
    """DeepSeek-V3's layout: F8_E4M3 values and an fp32 scale_inv per block."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block), math.ceil(cols / block))
    padded = torch.zeros(grid[0] * block, grid[1] * block)
    padded[:rows, :cols] = weight.float()
    amax = padded.abs().view(grid[0], block, grid[1], block).amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / 448
    full = scale_inv.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (weight.float() / full).to(torch.float8_e4m3fn), scale_inv


def test_inspect_deepseek_v3_counts_like_transformers(build_dir, tmp_path):
    # 256 experts over 2 MoE layers: the 512 router-bias elements and 1,536 FP8
    # scales are far above the 0.1K resolution of the printed counts, so
    # counting either would show.
    config = DeepseekV3Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                              moe_intermediate_size=8, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=256, num_experts_per_tok=8,
                              n_group=8, topk_group=4, first_k_dense_replace=1, q_lora_rank=24,
                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    model.save_pretrained(tmp_path / "bf", max_shard_size="300KB")
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - routed + routed * 8 / 256  # shared experts always active
    buffers = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    assert buffers == 512

    got_total, got_active, text = inspect_counts(build_dir, tmp_path / "bf")
    assert abs(got_total - total) <= 51 and abs(got_active - active) <= 51, text
    assert "dense MLP in layers [0]" in text
    assert "not parameters: 512 in 2 buffers" in text

    # The published layout: FP8 Linear weights with block scales, and the MTP
    # module stored as model.layers.3 (num_nextn_predict_layers 1).
    hf_config = json.loads((tmp_path / "bf" / "config.json").read_text())
    assert hf_config["num_nextn_predict_layers"] == 1
    tensors = {}
    for f in (tmp_path / "bf").glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    fp8 = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and t.dim() == 2 and not name.endswith("mlp.gate.weight"):
            fp8[name], fp8[name + "_scale_inv"] = to_block_fp8(t)
        else:
            fp8[name] = t
    mtp = {n.replace("model.layers.2.", "model.layers.3."): t for n, t in fp8.items()
           if n.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    mtp["model.layers.3.eh_proj.weight_scale_inv"] = torch.ones(1, 1)
    mtp["model.layers.3.enorm.weight"] = torch.ones(32)
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(hf_config))
    save_file(fp8, str(tmp_path / "fp8" / "model.safetensors"))
    save_file(mtp, str(tmp_path / "fp8" / "mtp.safetensors"))

    got_total, got_active, text = inspect_counts(build_dir, tmp_path / "fp8")
    assert abs(got_total - total) <= 51 and abs(got_active - active) <= 51, text
    assert "F8_E4M3" in text
    assert re.search(r"MTP layers: \[3\] \(num_nextn_predict_layers 1\)", text), text
    assert "FP8 block scales" in text
    assert "dense MLP in layers [0]" in text
    assert "3 layers, 2 with routed experts" in text


def test_inspect_missing_path(build_dir, tmp_path):
    out = subprocess.run([str(build_dir / "launch/moefit"), "inspect", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "no such file or directory" in out.stderr


def test_inspect_compressed_tensors_int4_counts_like_transformers(build_dir, tmp_path):
    """Kimi-K2-Thinking's layout: routed experts pack-quantized int4 by the
    compressed-tensors library. Packed weights count by their logical shapes
    (8 values per int32), not by their words; scales and shapes are no
    parameters; the quantization format is shown."""
    from compressed_tensors.quantization import QuantizationConfig
    from test_compressed_tensors import compress, scheme_of

    config = DeepseekV3Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                              moe_intermediate_size=8, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=256, num_experts_per_tok=8,
                              n_group=8, topk_group=4, first_k_dense_replace=1, q_lora_rank=24,
                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf", max_shard_size="300KB")
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - routed + routed * 8 / 256

    scheme = scheme_of(8, True)
    tensors, packed_words = {}, 0
    for f in (tmp_path / "bf").glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            if ".mlp.experts." in name:
                for suffix, c in compress(t, scheme).items():
                    tensors[name[:-len("weight")] + suffix] = c
                packed_words += tensors[name + "_packed"].numel()
            else:
                tensors[name] = t
    hf_config = json.loads((tmp_path / "bf" / "config.json").read_text())
    hf_config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", quantization_status="compressed",
        ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]).model_dump()
    (tmp_path / "int4").mkdir()
    (tmp_path / "int4" / "config.json").write_text(json.dumps(hf_config))
    # The shapes in a file of their own: they are found wherever they are.
    save_file({n: t for n, t in tensors.items() if not n.endswith("_shape")},
              str(tmp_path / "int4" / "model-00001-of-00002.safetensors"))
    save_file({n: t for n, t in tensors.items() if n.endswith("_shape")},
              str(tmp_path / "int4" / "model-00002-of-00002.safetensors"))

    got_total, got_active, text = inspect_counts(build_dir, tmp_path / "int4")
    # Counting the words instead (1/8 of the routed experts) would be far off.
    assert packed_words * 8 == routed
    assert abs(got_total - total) <= 51 and abs(got_active - active) <= 51, text
    assert "quantization: compressed-tensors pack-quantized int4, group 8, symmetric" in text, text
    assert re.search(r"int4 [0-9.]+K", text), text
    assert "quantization scales, zero points and shapes (*.weight_scale, *.weight_shape)" in text, text
    assert "3 layers, 2 with routed experts" in text
