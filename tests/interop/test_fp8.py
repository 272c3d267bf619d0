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
import re
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


# A frozen base's routed experts stay FP8 under LoRA: a deepseek_v3 directory
# as DeepSeek publishes it (every projection FP8 in 128 x 128 blocks, experts
# per expert), with moe_intermediate_size 128 so that gate and up each fill
# whole blocks.
LORA_TARGETS = "[q_a_proj,kv_b_proj,o_proj,experts]"


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory):
    from test_reference_model import quantize_fp8
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=256, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
        moe_intermediate_size=128, intermediate_size=96, first_k_dense_replace=1, n_group=2,
        topk_group=1, num_experts_per_tok=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)  # spread the router: no near ties in the top-k
    inter, block = config.moe_intermediate_size, [128, 128]
    tensors, reference = {}, {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix, deq_all = name.rsplit(".", 1)[0], []
            for e in range(t.shape[0]):
                parts = ({"gate_proj": t[e, :inter], "up_proj": t[e, inter:]}
                         if name.endswith("gate_up_proj") else {"down_proj": t[e]})
                deq_parts = []
                for proj, w in parts.items():
                    key = f"{prefix}.{e}.{proj}.weight"
                    tensors[key], tensors[key + "_scale_inv"], deq = quantize_fp8(w.float().contiguous(), block)
                    deq_parts.append(deq)
                deq_all.append(torch.cat(deq_parts))
            reference[name] = torch.stack(deq_all)
        elif t.dim() == 2 and name.endswith("_proj.weight"):
            tensors[name], tensors[name + "_scale_inv"], deq = quantize_fp8(t.float(), block)
            reference[name] = deq.bfloat16().float()  # moefit keeps the frozen dense part in bf16
        else:
            tensors[name] = t.bfloat16() if t.dim() == 2 and "mlp.gate." not in name else t
            reference[name] = tensors[name].float()
    path = tmp_path_factory.mktemp("fp8_lora")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config = config.to_diff_dict()  # what save_pretrained writes
    hf_config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                        "quant_method": "fp8", "weight_block_size": block}
    (path / "config.json").write_text(json.dumps(hf_config))
    model.load_state_dict(reference)
    return path, model


def train_lora(build_dir, model_dir, out, *extra, np=1):
    from test_reference_model import moefit
    metrics = out.with_suffix(".jsonl")
    log = moefit(build_dir, "train", "--set", f"model.model_path={model_dir}", "--set", "train.steps=4",
                 "--set", "train.seq_len=32", "--set", f"train.micro_batch_size={4 // np}",
                 "--set", "optimizer.lr=2e-2", "--set", "schedule.warmup_steps=0",
                 "--set", "train.mode=lora", "--set", "lora.rank=4", "--set", "lora.alpha=8",
                 "--set", f"lora.target_modules={LORA_TARGETS}", "--set", f"checkpoint.save_dir={out}",
                 "--set", f"logging.metrics_file={metrics}", *extra, np=np)
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    return log, losses


def test_lora_keeps_fp8_experts_as_stored(build_dir, fp8_deepseek, tmp_path):
    """By default the experts of an FP8 checkpoint stay FP8 under LoRA (the
    log says so, and the weights take half the bytes of bfloat16 ones); they
    train the adapter exactly as their bfloat16 dequantization does on the
    reference backend and within 1e-3 on the kernels; two processes train the
    adapter of one; and PEFT puts the adapter on transformers' model of the
    dequantized weights with moefit's logits (within 5e-3: the experts
    compute in bfloat16)."""
    from peft import PeftModel
    from test_reference_model import moefit_logits

    model_dir, reference = fp8_deepseek
    log, fp8 = train_lora(build_dir, model_dir, tmp_path / "fp8")
    assert "frozen base in bfloat16 (dense) and float8_e4m3fn (experts)" in log
    weights = lambda text: float(re.search(r"weights ([0-9.]+) MiB", text).group(1))
    log_bf16, bf16 = train_lora(build_dir, model_dir, tmp_path / "bf16", "--set", "experts.dtype=bfloat16")
    assert "float8_e4m3fn" not in log_bf16
    # Experts are most of this model: 8 x 3 x 64 x 128 per MoE layer.
    assert weights(log) < 0.75 * weights(log_bf16), (weights(log), weights(log_bf16))
    assert len(fp8) == 4 and fp8[-1] < fp8[0]
    assert fp8 == pytest.approx(bf16, rel=1e-3)
    _, fp8_eager = train_lora(build_dir, model_dir, tmp_path / "fp8_eager", "--set", "experts.backend=eager")
    _, bf16_eager = train_lora(build_dir, model_dir, tmp_path / "bf16_eager", "--set", "experts.backend=eager",
                               "--set", "experts.dtype=bfloat16")
    assert fp8_eager == bf16_eager
    _, two = train_lora(build_dir, model_dir, tmp_path / "fp8_np2", np=2)
    assert two == pytest.approx(fp8, rel=1e-5)

    adapter = tmp_path / "fp8"
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    peft_model = PeftModel.from_pretrained(reference, adapter).eval()
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits.float()
    got = moefit_logits(build_dir, model_dir, ids, tmp_path, "--set", f"lora.adapter_path={adapter}")
    plain = moefit_logits(build_dir, model_dir, ids, tmp_path)
    err = (got - expected).abs().max().item()
    effect = (plain - expected).abs().max().item()
    print(f"fp8 LoRA vs PEFT: max |logit difference| {err:.3g}, adapter effect {effect:.3g}")
    assert err < 5e-3 and effect > 100 * err, (err, effect)


def test_fp8_experts_that_cannot_stay_fp8_are_named(build_dir, checkpoint, tmp_path):
    """experts.dtype float8_e4m3fn asked of a model whose gate and up halves do
    not fill whole 128-row blocks (moe_intermediate_size 136) fails naming
    the field and the size, before anything is loaded."""
    src = tmp_path / "model"
    src.mkdir()
    (src / "model.safetensors").symlink_to(checkpoint[0] / "model.safetensors")
    config = {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": HIDDEN,
              "num_hidden_layers": 1, "num_attention_heads": 2, "q_lora_rank": Q_RANK,
              "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
              "n_routed_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": INTER,
              "n_shared_experts": 1, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
              "num_nextn_predict_layers": 1,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    (src / "config.json").write_text(json.dumps(config))
    from test_reference_model import MPI_ENV
    run = subprocess.run([str(build_dir / "launch/moefit"), "train", "--set", f"model.model_path={src}",
                          "--set", "train.mode=lora", "--set", "lora.rank=4",
                          "--set", "lora.target_modules=[experts]",
                          "--set", "experts.dtype=float8_e4m3fn",
                          "--set", "train.steps=1"], capture_output=True, text=True, timeout=120, env=MPI_ENV)
    assert run.returncode != 0
    assert "moe_intermediate_size a multiple of 128" in run.stderr and "136" in run.stderr, run.stderr


def test_converted_checkpoint_keeps_bfloat16_experts(build_dir, fp8_deepseek, tmp_path):
    """A bfloat16 conversion that kept config.json's quantization_config (as
    DeepSeek's own cast script does) trains with bfloat16 experts by default;
    asking for FP8 experts there fails naming experts.dtype and the directory."""
    from test_reference_model import MPI_ENV
    model_dir, _ = fp8_deepseek
    stored = load_file(str(model_dir / "model.safetensors"))
    converted = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        scale = stored.get(name + "_scale_inv")
        converted[name] = dequantize(t, scale, torch.bfloat16) if scale is not None else t
    out = tmp_path / "bf16"
    out.mkdir()
    save_file(converted, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((model_dir / "config.json").read_text())
    log, losses = train_lora(build_dir, out, tmp_path / "adapter")
    assert "frozen base in bfloat16 (dense) and bfloat16 (experts)" in log and len(losses) == 4
    run = subprocess.run([str(build_dir / "launch/moefit"), "train", "--set", f"model.model_path={out}",
                          "--set", "train.mode=lora", "--set", "lora.rank=4",
                          "--set", "lora.target_modules=[experts]", "--set", "train.steps=1",
                          "--set", "experts.dtype=float8_e4m3fn"],
                         capture_output=True, text=True, timeout=120, env=MPI_ENV)
    assert run.returncode == 2, run.stderr
    assert "experts.dtype = 'float8_e4m3fn'" in run.stderr and str(out) in run.stderr, run.stderr


def test_eval_keeps_fp8_experts(build_dir, fp8_deepseek, tmp_path):
    """moefit eval with experts.dtype=float8_e4m3fn holds the experts as stored
    (fewer weight bytes than bfloat16) and computes the logits of their
    bfloat16 dequantization: equal on the reference backend, within 3e-3 on
    the kernels (equal where they multiply bfloat16 pairs; the float32 kernels
    of AVX2 and AVX-512F take FP8 x scale unrounded, 1.3e-3 away on an AVX2
    CPU), and two processes give the logits of one."""
    from test_reference_model import moefit
    model_dir, _ = fp8_deepseek
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, str(tmp_path / "ids.safetensors"))

    def logits(dtype, backend, np=1):
        out = tmp_path / f"{dtype}_{backend}_{np}.safetensors"
        log = moefit(build_dir, "eval", "--set", f"model.model_path={model_dir}",
                     "--set", f"experts.dtype={dtype}", "--set", f"experts.backend={backend}",
                     "--save-logits", out, "--input-ids", tmp_path / "ids.safetensors", np=np)
        return float(re.search(r"weights ([0-9.]+) MiB", log).group(1)), load_file(str(out))["logits"]

    fp8_bytes, fp8 = logits("float8_e4m3fn", "eager")
    bf16_bytes, bf16 = logits("bfloat16", "eager")
    assert fp8_bytes < 0.75 * bf16_bytes
    assert torch.equal(fp8, bf16)
    _, fp8_grouped = logits("float8_e4m3fn", "grouped")
    _, bf16_grouped = logits("bfloat16", "grouped")
    err = (fp8_grouped - bf16_grouped).abs().max().item()
    print(f"eval, grouped: fp8 vs bfloat16 experts max |logit difference| {err:.3g}")
    assert err < 3e-3
    _, two = logits("float8_e4m3fn", "grouped", np=2)
    assert (two - fp8_grouped).abs().max().item() < 1e-4


def test_lora_on_fp8_experts_resumes_exactly(build_dir, fp8_deepseek, tmp_path):
    """A LoRA run on FP8 experts stopped at a training checkpoint continues bit
    for bit: the frozen FP8 base comes again from the checkpoint directory."""
    model_dir, _ = fp8_deepseek
    _, whole = train_lora(build_dir, model_dir, tmp_path / "whole", "--set", "checkpoint.save_every_steps=2")
    step2 = tmp_path / "whole" / "step-00000002"
    assert (step2 / "manifest.binpb").exists()
    log, resumed = train_lora(build_dir, model_dir, tmp_path / "resumed",
                              "--set", f"checkpoint.resume_from={step2}")
    assert "float8_e4m3fn (experts)" in log and "resumed from" in log
    assert len(whole) == 4 and resumed == whole[2:]
