"""moefit reads compressed-tensors checkpoints as the compressed-tensors library writes them.

Kimi-K2-Thinking publishes its routed experts pack-quantized to 4-bit integers
by the compressed-tensors library: `X.weight_packed` (int32, eight values a
word), `X.weight_scale` (bfloat16, one per group of inputs), `X.weight_shape`,
and for asymmetric schemes `X.weight_zero_point` (packed along the rows). Here
the library itself quantizes a tiny DeepSeek-V3 model's routed and shared
experts -- scales and zero points from its calculate_qparams over each group's
minimum and maximum, packing by PackedQuantizationCompressor.compress -- and
config.json carries the library's own QuantizationConfig dump. moefit's
loader (through `safetensors_tool load`, and `moefit export` from config.json
alone) must give, bit for bit, what the library's decompress gives: bfloat16
(the scales' dtype), and the same values in float32.
"""

import json
import os
import subprocess

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                             QuantizationScheme)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file
from test_fp8 import load  # safetensors_tool load, as the FP8 tests run it

EXPERTS = 4
MOE = "model.layers.1.mlp."  # layer 0 is dense (first_k_dense_replace 1)
# What the checkpoint quantizes, as module names; the rest is listed in `ignore`.
QUANTIZED = ("mlp.experts.", "mlp.shared_experts.")
IGNORE = ["lm_head", "re:.*self_attn.*", r"re:.*mlp\.(gate|up|down)_proj$", r"re:.*mlp\.gate$"]


def scheme_of(group_size, symmetric):
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group",
                            group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def compress(weight, scheme):
    """The library's compression of one Linear: qparams over each group's range, then pack."""
    group_size = scheme.weights.group_size
    rows, cols = weight.shape
    groups = weight.view(rows, cols // group_size, group_size)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    return PackedQuantizationCompressor.compress(
        {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)


def decompress(tensors, name, scheme):
    prefix = name[:-len("weight")]
    module = {k[len(prefix):]: t for k, t in tensors.items()
              if k.startswith(prefix) and k[len(prefix):].startswith("weight_")}
    return PackedQuantizationCompressor.decompress(module, scheme)["weight"]


@pytest.fixture(scope="module", params=[(32, True, 64, 32), (128, True, 128, 128), (32, False, 64, 96)],
                ids=["group32-symmetric", "group128-symmetric", "group32-asymmetric"])
def int4_model(request, tmp_path_factory):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    group_size, symmetric, hidden, inter = request.param
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=300, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=EXPERTS, n_shared_experts=1,
        moe_intermediate_size=inter, intermediate_size=96, first_k_dense_replace=1, n_group=1,
        topk_group=1, num_experts_per_tok=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    dense_dir = tmp_path_factory.mktemp("dense")
    model.save_pretrained(dense_dir)
    dense = {}
    for f in dense_dir.glob("*.safetensors"):
        dense.update(load_file(str(f)))

    scheme = scheme_of(group_size, symmetric)
    tensors, quantized = {}, []
    for name, t in dense.items():
        if any(q in name for q in QUANTIZED) and name.endswith("_proj.weight"):
            for suffix, c in compress(t, scheme).items():
                tensors[name[:-len("weight")] + suffix] = c
            quantized.append(name)
        else:
            tensors[name] = t
    path = tmp_path_factory.mktemp("int4")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((dense_dir / "config.json").read_text())
    hf_config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized",
        quantization_status="compressed", ignore=IGNORE).model_dump()
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    return path, tensors, dense, quantized, scheme


def int4_flag(scheme):
    w = scheme.weights
    return f"{w.group_size},{'symmetric' if w.symmetric else 'asymmetric'}"


def test_checkpoint_is_the_librarys_format(int4_model):
    _, tensors, _, quantized, scheme = int4_model
    packed = tensors[MOE + "experts.0.down_proj.weight_packed"]
    assert packed.dtype == torch.int32
    assert tensors[MOE + "experts.0.down_proj.weight_scale"].dtype == torch.bfloat16
    assert (MOE + "experts.0.down_proj.weight_zero_point" in tensors) == (not scheme.weights.symmetric)
    assert len(quantized) == 3 * EXPERTS + 3


@pytest.mark.parametrize("dtype_name,dtype", [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_loaded_values_equal_the_librarys_decompression(tool, int4_model, tmp_path, dtype_name, dtype):
    src, tensors, dense, quantized, scheme = int4_model
    report, runtime = load(tool, src, tmp_path / "out.safetensors", "--dtype", dtype_name,
                           "--int4", int4_flag(scheme))
    assert report["missing"] == [] and report["unexpected"] == [] and report["mismatched"] == []
    ref = {name: decompress(tensors, name, scheme) for name in quantized}
    assert all(t.dtype == torch.bfloat16 for t in ref.values())  # the scales' dtype
    expert = lambda e, proj: ref[f"{MOE}experts.{e}.{proj}.weight"].to(dtype)
    gate_up = torch.stack([torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")])
                           for e in range(EXPERTS)])
    down = torch.stack([expert(e, "down_proj") for e in range(EXPERTS)])
    assert torch.equal(runtime[MOE + "experts.gate_up_proj"], gate_up)
    assert torch.equal(runtime[MOE + "experts.down_proj"], down)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"{MOE}shared_experts.{proj}.weight"
        assert torch.equal(runtime[name], ref[name].to(dtype)), name
    # What the library left alone is read as stored.
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.self_attn.kv_b_proj.weight"):
        assert torch.equal(runtime[name], dense[name].to(dtype)), name
    assert report["num_bytes_read"] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_rank_reads_only_its_experts(tool, int4_model, tmp_path):
    src, tensors, _, _, scheme = int4_model
    report, runtime = load(tool, src, tmp_path / "out.safetensors", "--int4", int4_flag(scheme),
                           "--first-expert", 2, "--num-experts", 2)
    mine = lambda n: ".experts." not in n or ".experts.2." in n or ".experts.3." in n
    assert report["num_bytes_read"] == sum(t.numel() * t.element_size()
                                           for n, t in tensors.items() if mine(n))
    down = torch.stack([decompress(tensors, f"{MOE}experts.{e}.down_proj.weight", scheme) for e in (2, 3)])
    assert torch.equal(runtime[MOE + "experts.down_proj"], down)  # bf16 without a dtype


def test_lora_on_int4_experts_trains_as_on_their_dequantization(build_dir, int4_model, tmp_path):
    """experts.dtype int4 keeps the routed experts as stored, in the checkpoint's
    groups and with its zero points: two LoRA steps give, bit for bit, the
    losses of the same run on the experts the loader dequantizes to bfloat16."""
    src, *_ = int4_model
    moefit = build_dir / "launch" / "moefit"

    def losses(dtype):
        metrics = tmp_path / f"{dtype}.jsonl"
        sets = [f"model.model_path={src}", f"experts.dtype={dtype}", "train.mode=lora",
                "lora.rank=4", "lora.target_modules=[q_a_proj,experts]", "train.steps=2",
                "train.seq_len=32", "train.micro_batch_size=2", "parallel.device=cpu",
                f"logging.metrics_file={metrics}"]
        result = subprocess.run([str(moefit), "train", *[a for s in sets for a in ("--set", s)]],
                                capture_output=True, text=True, timeout=300,
                                env=dict(os.environ, MOEFIT_NUM_THREADS="1"))
        assert result.returncode == 0, result.stdout + result.stderr
        return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]

    int4 = losses("int4")
    assert len(int4) == 2
    assert int4 == losses("bfloat16")


def test_export_from_config_json_alone(build_dir, int4_model, tmp_path):
    """`moefit export` reads the library's QuantizationConfig dump from config.json,
    dequantizes, and writes what the library's decompress gives."""
    src, tensors, _, quantized, scheme = int4_model
    moefit = build_dir / "launch" / "moefit"
    if not moefit.is_file():
        pytest.fail(f"{moefit} not found: build the moefit target first")
    out = tmp_path / "exported"
    result = subprocess.run([str(moefit), "export", str(src), str(out)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(str(f)))
    for name in quantized:
        assert torch.equal(exported[name], decompress(tensors, name, scheme)), name
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_unsupported_scheme_is_named(build_dir, int4_model, tmp_path):
    """A scheme moefit does not read (8-bit integers here) stops `moefit export`
    with exit 2 and the field's name."""
    src, _, _, _, scheme = int4_model
    hf_config = json.loads((src / "config.json").read_text())
    hf_config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(hf_config))
    (bad / "model.safetensors").symlink_to(src / "model.safetensors")
    result = subprocess.run([str(build_dir / "launch" / "moefit"), "export", str(bad), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert ("model.quantization_config.config_groups.group_0.weights.num_bits = 8: "
            "pack-quantized weights are read as 4-bit integers") in result.stderr


# llm-compressor's FP8 block variant: float-quantized `X.weight` (F8_E4M3)
# with `X.weight_scale` per block, here blocks of [16, 32] so that the
# 24-row q_a_proj and the 32-wide experts end in partial blocks.
FP8_BLOCK = [16, 32]


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(1)
    config = DeepseekV3Config(
        vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=EXPERTS, n_shared_experts=1,
        moe_intermediate_size=40, intermediate_size=96, first_k_dense_replace=1, n_group=1,
        topk_group=1, num_experts_per_tok=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    dense_dir = tmp_path_factory.mktemp("fp8_dense")
    model.save_pretrained(dense_dir)
    dense = load_file(str(next(dense_dir.glob("*.safetensors"))))
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                            block_structure=FP8_BLOCK)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="float-quantized")
    tensors, quantized = {}, []
    for name, t in dense.items():
        if (".mlp.experts." in name or "q_a_proj" in name) and name.endswith(".weight"):
            rows, cols = t.shape
            b0, b1 = FP8_BLOCK
            grid = (-(-rows // b0), -(-cols // b1))
            padded = torch.zeros(grid[0] * b0, grid[1] * b1, dtype=t.dtype)
            padded[:rows, :cols] = t
            blocks = padded.view(grid[0], b0, grid[1], b1)
            scale, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), args)
            compressed = FloatQuantizationCompressor.compress({"weight": t, "weight_scale": scale},
                                                              scheme)
            tensors[name], tensors[name + "_scale"] = compressed["weight"], compressed["weight_scale"]
            quantized.append(name)
        else:
            tensors[name] = t
    path = tmp_path_factory.mktemp("fp8")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((dense_dir / "config.json").read_text())
    hf_config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format="float-quantized",
        quantization_status="compressed", ignore=IGNORE).model_dump()
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    decompressed = {
        name: FloatQuantizationCompressor.decompress(
            {"weight": tensors[name], "weight_scale": tensors[name + "_scale"]}, scheme)["weight"]
        for name in quantized}
    return path, tensors, quantized, decompressed


def test_fp8_blocks_load_as_the_library_decompresses(tool, build_dir, fp8_model, tmp_path):
    """Into bfloat16 (the scales' dtype) the values are the library's bit for
    bit, through safetensors_tool and through `moefit export` from config.json."""
    src, tensors, quantized, ref = fp8_model
    assert tensors[quantized[0]].dtype == torch.float8_e4m3fn
    assert all(t.dtype == torch.bfloat16 for t in ref.values())
    report, runtime = load(tool, src, tmp_path / "out.safetensors", "--dtype", "bfloat16",
                           "--fp8-scale-suffix", "_scale", "--fp8-block", "16,32")
    assert report["missing"] == [] and report["unexpected"] == [] and report["mismatched"] == []
    expert = lambda e, proj: ref[f"{MOE}experts.{e}.{proj}.weight"]
    assert torch.equal(runtime[MOE + "experts.gate_up_proj"],
                       torch.stack([torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")])
                                    for e in range(EXPERTS)]))
    assert torch.equal(runtime[MOE + "experts.down_proj"],
                       torch.stack([expert(e, "down_proj") for e in range(EXPERTS)]))
    q_a = "model.layers.0.self_attn.q_a_proj.weight"
    assert torch.equal(runtime[q_a], ref[q_a])

    out = tmp_path / "exported"
    result = subprocess.run([str(build_dir / "launch" / "moefit"), "export", str(src), str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    exported = load_file(str(next(out.glob("*.safetensors"))))
    for name in quantized:
        assert torch.equal(exported[name], ref[name]), name


def reference_model(src, tensors, dense, quantized, scheme, tmp_path):
    """transformers' model of what the library decompresses, in float32: the
    quantized weights as its decompress gives them, the rest as stored."""
    from transformers import AutoModelForCausalLM

    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    weights = dict(dense)
    for name in quantized:
        weights[name] = decompress(tensors, name, scheme)
    save_file(weights, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((src / "config.json").read_text())
    del hf_config["quantization_config"]
    (ref_dir / "config.json").write_text(json.dumps(hf_config))
    return AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


def test_eval_keeps_int4_experts_with_the_logits_of_transformers(build_dir, int4_model, tmp_path):
    """`moefit eval` keeps the routed experts int4 as stored and gives
    transformers' logits on the decompressed model (float32) within
    5e-3: the experts compute in bfloat16. On the kernels and on the reference
    backend the int4 experts give exactly the logits of their bfloat16
    dequantization (an int4 element is a bfloat16 value on every instruction
    set), and two processes give the logits of one."""
    from test_reference_model import moefit_logits

    src, tensors, dense, quantized, scheme = int4_model
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))

    def logits(*extra, np=1):
        return moefit_logits(build_dir, src, ids, tmp_path, *extra, np=np)

    int4 = logits()
    reference = reference_model(src, tensors, dense, quantized, scheme, tmp_path)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits.float()
    err = (int4 - expected).abs().max().item()
    print(f"eval int4 (group {scheme.weights.group_size}, symmetric {scheme.weights.symmetric}) "
          f"vs transformers on the decompressed model: max |logit difference| {err:.3g}")
    assert err < 5e-3
    bf16 = logits("--set", "experts.dtype=bfloat16")
    assert torch.equal(int4, bf16)
    int4_eager = logits("--set", "experts.backend=eager")
    bf16_eager = logits("--set", "experts.backend=eager", "--set", "experts.dtype=bfloat16")
    assert torch.equal(int4_eager, bf16_eager)
    two = logits(np=2)
    assert (two - int4).abs().max().item() < 1e-4


def test_lora_on_int4_experts_loads_in_peft(build_dir, int4_model, tmp_path):
    """Under LoRA the experts of an int4 checkpoint stay int4 by default; two
    processes train the adapter with the losses of the same run on the
    experts' bfloat16 dequantization (exactly: the same bits); and PEFT puts
    the adapter on transformers' model of the decompressed weights with
    moefit's logits (within 5e-3: the experts compute in bfloat16)."""
    from peft import PeftModel
    from test_fp8 import train_lora
    from test_reference_model import moefit_logits

    src, tensors, dense, quantized, scheme = int4_model

    def train(out, *extra):
        return train_lora(build_dir, src, out, "--set", "experts.num_threads=1", *extra, np=2)

    log, int4 = train(tmp_path / "int4")
    assert "frozen base in bfloat16 (dense) and int4 (experts)" in log, log
    assert len(int4) == 4 and int4[-1] < int4[0]
    _, bf16 = train(tmp_path / "bf16", "--set", "experts.dtype=bfloat16")
    assert int4 == bf16

    reference = reference_model(src, tensors, dense, quantized, scheme, tmp_path)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    peft_model = PeftModel.from_pretrained(reference, tmp_path / "int4").eval()
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits.float()
    got = moefit_logits(build_dir, src, ids, tmp_path, "--set", f"lora.adapter_path={tmp_path / 'int4'}")
    plain = moefit_logits(build_dir, src, ids, tmp_path)
    err = (got - expected).abs().max().item()
    effect = (plain - expected).abs().max().item()
    print(f"int4 LoRA vs PEFT: max |logit difference| {err:.3g}, adapter effect {effect:.3g}")
    assert err < 5e-3 and effect > 100 * err, (err, effect)
