"""moefit reads block-scaled FP8 checkpoints as the real `safetensors` package writes them.

DeepSeek-V3 / Kimi-K2 publish Linear weights as torch.float8_e4m3fn with an
fp32 `<name>_scale_inv` per 128 x 128 block. Here a tiny checkpoint of that
shape is written with safetensors.torch.save_file (sizes that are not
multiples of the block, so edge blocks are partial; per-expert experts; an MTP
layer after the decoder layers), dequantized in torch as the reference, and
loaded by moefit's LoadCheckpoint through `safetensors_tool load`, which writes
the runtime tensors back to a file read here. moefit must give the reference's
values exactly (the product in fp32, rounded once to the target dtype), read
only its own experts' bytes, and skip the MTP layer.
"""

import json
import math
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

BLOCK = (128, 128)
HIDDEN, Q_RANK, INTER, VOCAB, EXPERTS = 200, 300, 136, 16, 4
LAYER, MTP = "model.layers.0.", "model.layers.1."


def fp8_pair(rows, cols, gen):
    # Inside E4M3's range (+-448), scales as the published checkpoints have them.
    weight = (torch.randn(rows, cols, generator=gen) * 50).clamp(-440, 440).to(torch.float8_e4m3fn)
    scale = torch.rand(math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1]), generator=gen) * 1e-3 + 1e-4
    return weight, scale


def dequantize(weight, scale, dtype):
    """The reference: each block's values times its scale, in fp32, then cast."""
    rows, cols = weight.shape
    full = scale.float().repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    return (weight.float() * full).to(dtype)


def expert(e, proj):
    return f"{LAYER}mlp.experts.{e}.{proj}.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16(),
        "model.norm.weight": torch.randn(HIDDEN, generator=gen).bfloat16(),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16(),
        LAYER + "input_layernorm.weight": torch.randn(HIDDEN, generator=gen).bfloat16(),
        LAYER + "mlp.gate.weight": torch.randn(EXPERTS, HIDDEN, generator=gen).bfloat16(),
        LAYER + "mlp.gate.e_score_correction_bias": torch.randn(EXPERTS, generator=gen),
    }
    fp8 = {LAYER + "self_attn.q_a_proj.weight": (Q_RANK, HIDDEN),
           LAYER + "mlp.shared_experts.down_proj.weight": (HIDDEN, INTER)}
    for e in range(EXPERTS):
        fp8[expert(e, "gate_proj")] = (INTER, HIDDEN)
        fp8[expert(e, "up_proj")] = (INTER, HIDDEN)
        fp8[expert(e, "down_proj")] = (HIDDEN, INTER)
    fp8[MTP + "eh_proj.weight"] = (HIDDEN, 2 * HIDDEN)
    for name, (rows, cols) in fp8.items():
        tensors[name], tensors[name + "_scale_inv"] = fp8_pair(rows, cols, gen)
    tensors[MTP + "enorm.weight"] = torch.randn(HIDDEN, generator=gen).bfloat16()
    path = tmp_path_factory.mktemp("fp8")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, tensors


def load(tool, src, out, *flags):
    result = subprocess.run([str(tool), "load", str(src), "deepseek_v3", str(out), *map(str, flags)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), load_file(str(out))


@pytest.mark.parametrize("dtype_name,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_fp8_loads_as_torch_dequantizes(tool, checkpoint, tmp_path, dtype_name, dtype):
    src, disk = checkpoint
    report, runtime = load(tool, src, tmp_path / "out.safetensors", "--dtype", dtype_name,
                           "--skip-layers-from", 1)
    ref = lambda name: dequantize(disk[name], disk[name + "_scale_inv"], dtype)
    assert torch.equal(runtime[LAYER + "self_attn.q_a_proj.weight"], ref(LAYER + "self_attn.q_a_proj.weight"))
    assert torch.equal(runtime[LAYER + "mlp.shared_experts.down_proj.weight"],
                       ref(LAYER + "mlp.shared_experts.down_proj.weight"))
    gate_up = torch.stack([torch.cat([ref(expert(e, "gate_proj")), ref(expert(e, "up_proj"))])
                           for e in range(EXPERTS)])
    down = torch.stack([ref(expert(e, "down_proj")) for e in range(EXPERTS)])
    assert torch.equal(runtime[LAYER + "mlp.experts.gate_up_proj"], gate_up)
    assert torch.equal(runtime[LAYER + "mlp.experts.down_proj"], down)
    assert torch.equal(runtime["model.embed_tokens.weight"], disk["model.embed_tokens.weight"].to(dtype))
    assert not any(name.endswith("_scale_inv") for name in runtime)
    assert report["unexpected"] == [] and report["missing"] == [] and report["mismatched"] == []
    assert report["skipped"] == sorted(n for n in disk if n.startswith(MTP))


def test_fp8_rank_reads_only_its_experts(tool, checkpoint, tmp_path):
    src, disk = checkpoint
    report, runtime = load(tool, src, tmp_path / "out.safetensors", "--first-expert", 2,
                           "--num-experts", 2, "--skip-layers-from", 1)
    mine = lambda n: ".experts." not in n or ".experts.2." in n or ".experts.3." in n
    want = sum(t.numel() * t.element_size() for n, t in disk.items() if not n.startswith(MTP) and mine(n))
    assert report["num_bytes_read"] == want
    down = torch.stack([dequantize(disk[expert(e, "down_proj")], disk[expert(e, "down_proj") + "_scale_inv"],
                                   torch.bfloat16) for e in (2, 3)])
    assert torch.equal(runtime[LAYER + "mlp.experts.down_proj"], down)  # bf16 without a dtype


def test_fp8_missing_scale_is_named(tool, checkpoint, tmp_path):
    _, disk = checkpoint
    dropped = expert(1, "up_proj") + "_scale_inv"
    save_file({n: t for n, t in disk.items() if n != dropped}, str(tmp_path / "model.safetensors"))
    result = subprocess.run([str(tool), "load", str(tmp_path), "deepseek_v3", str(tmp_path / "out"),
                             "--skip-layers-from", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert json.loads(result.stdout)["missing"] == [dropped]
    assert dropped in result.stderr
