"""moefit against Hugging Face transformers, through model directories.

For each family (qwen3_moe, also with YaRN, qwen2_moe, mixtral, deepseek_v3
with and without the query bottleneck and with YaRN, glm4_moe), a tiny model built by
transformers with random weights is saved with save_pretrained (per-expert
checkpoint keys, sharded, with an index). Then:
  * `moefit eval --save-logits` on that directory equals the transformers
    forward (fp32; 1e-4 absolute on logits of order 1: the implementations sum
    in different orders, e.g. SDPA kernels and expert accumulation), with both
    expert backends and at 1 and 2 processes (3 for the sigmoid-routed families);
  * a directory moefit writes (`moefit export`, and the end-of-training save
    of `moefit train`) loads with AutoModelForCausalLM.from_pretrained with no
    missing, unexpected or mismatched keys; the exported one gives the same
    logits, the trained one the logits moefit computes for it.
"""
import json
import os
import re
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                          Glm4MoeConfig, Glm4MoeForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256)

FAMILIES = {
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(
        **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=11,
        norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1e6)),
    "qwen2_moe": (Qwen2MoeForCausalLM, lambda: Qwen2MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1)),
    "mixtral": (MixtralForCausalLM, lambda: MixtralConfig(
        **COMMON, intermediate_size=32, num_local_experts=6, tie_word_embeddings=False)),
}

# DeepSeek-V3 shapes in small: multi-head latent attention (with and without the
# query bottleneck), YaRN active (factor 4 over an original 64 positions, the two
# mscales different so both corrections count), sigmoid routing over 4 groups of 3
# experts of which 2 groups are eligible, a shared expert, a dense first layer.
def deepseek_v3_config(q_lora_rank):
    return lambda: DeepseekV3Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=256, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=12, n_shared_experts=1,
        moe_intermediate_size=32, intermediate_size=96, first_k_dense_replace=1, n_group=4,
        topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "rope_theta": 10000.0})


FAMILIES.update({
    # YaRN on an existing family: frequencies and the cos/sin attention factor.
    "qwen3_moe_yarn": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(
        **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        norm_topk_prob=True, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 64,
                                              "rope_theta": 1e6})),
    "deepseek_v3": (DeepseekV3ForCausalLM, deepseek_v3_config(24)),
    "deepseek_v3_no_q_lora": (DeepseekV3ForCausalLM, deepseek_v3_config(None)),
    # GLM-4.5 in small: rotary on half of each head, q/k/v biases, q/k norms,
    # sigmoid routing over 2 groups (1 eligible), a shared expert, a dense first layer.
    "glm4_moe": (Glm4MoeForCausalLM, lambda: Glm4MoeConfig(
        **COMMON, head_dim=16, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
        n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, moe_intermediate_size=32, intermediate_size=96)),
})
# Families routed by sigmoid scores with a correction bias: checked at 3 processes.
SIGMOID_FAMILIES = {"deepseek_v3", "deepseek_v3_no_q_lora", "glm4_moe"}
TOLERANCE = 1e-4
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               MOEFIT_NUM_THREADS="1")


def make_model(family, path):
    cls, config = FAMILIES[family]
    torch.manual_seed(0)
    model = cls(config()).eval()
    with torch.no_grad():  # spread the router so top-k choices are not near ties
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                p.mul_(20)
        # A correction bias that changes which experts are picked (it starts at 0).
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    model.save_pretrained(path, max_shard_size="150KB")
    return model


def moefit(build_dir, *args, np=1):
    cmd = [str(build_dir / "launch/moefit"), *map(str, args)]
    if np > 1:
        cmd = ["mpirun", "-np", str(np), "--oversubscribe", *cmd]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=MPI_ENV)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def moefit_logits(build_dir, model_dir, ids, tmp_path, *extra, np=1):
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    out = tmp_path / "logits.safetensors"
    moefit(build_dir, "eval", "--set", f"model.model_path={model_dir}", *extra,
           "--save-logits", out, "--input-ids", tmp_path / "ids.safetensors", np=np)
    return load_file(out)["logits"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eval_logits_match_transformers(family, build_dir, tmp_path):
    model = make_model(family, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()
    ranks = 3 if family in SIGMOID_FAMILIES else 2
    for backend, np in [("grouped", 1), ("eager", 1), ("grouped", ranks)]:
        got = moefit_logits(build_dir, tmp_path / "hf", ids, tmp_path,
                            "--set", f"experts.backend={backend}", np=np)
        err = (got - expected).abs().max().item()
        assert err < TOLERANCE, f"{family} {backend} np={np}: max |logit difference| {err:.3g}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exported_directory_loads_in_transformers(family, build_dir, tmp_path):
    model = make_model(family, tmp_path / "hf")
    moefit(build_dir, "export", tmp_path / "hf", tmp_path / "out", "--max-shard-bytes", 100000, np=2)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "glm4_moe"])
def test_trained_model_round_trips(family, build_dir, tmp_path):
    make_model(family, tmp_path / "hf")
    extra = []
    if family in SIGMOID_FAMILIES:  # the sequence-wise loss on, the correction bias moving
        extra = ["--set", "model.aux_loss_alpha=0.01", "--set", "router.bias_update_rate=0.01"]
    moefit(build_dir, "train", "--set", f"model.model_path={tmp_path / 'hf'}", "--set", "train.steps=3",
           "--set", "train.seq_len=32", "--set", "train.micro_batch_size=1", "--set",
           f"checkpoint.save_dir={tmp_path / 'trained'}", "--set", "logging.metrics_file=", *extra,
           np=2)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    changed = [n for n, p in loaded.named_parameters()
               if not torch.equal(p, original.state_dict()[n])]
    assert changed, "training changed no weight"
    if family in SIGMOID_FAMILIES:
        # Each step moved each bias by -rate, 0 (an expert at exactly the mean
        # load) or +rate: after 3 steps a multiple of 0.01 within +-0.03; and
        # the moved biases were saved as e_score_correction_bias.
        before = dict(original.named_buffers())
        for name, b in loaded.named_buffers():
            if name.endswith("e_score_correction_bias"):
                steps = ((b - before[name]) / 0.01).round()
                assert torch.allclose(b - before[name], steps * 0.01, atol=1e-6), name
                assert (steps.abs() <= 3).all() and (steps != 0).any(), (name, steps)
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        expected = loaded(input_ids=ids).logits
    got = moefit_logits(build_dir, tmp_path / "trained", ids, tmp_path)
    assert (got - expected).abs().max().item() < TOLERANCE


PACKED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up|down)_proj$")


def quantize_fp8(w, block):
    """DeepSeek's release format: e4m3 values and one fp32 scale per block
    (weight = fp8 * scale_inv), amax-scaled per block; edge blocks are partial."""
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // block[0]), -(-in_dim // block[1])
    scale = torch.empty(rows, cols)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]]
            scale[r, c] = tile.abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block[0], 0)[:out_dim].repeat_interleave(block[1], 1)[:, :in_dim]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def test_fp8_checkpoint_with_mtp_layer_matches_dequantized_reference(build_dir, tmp_path):
    """A deepseek_v3 directory as DeepSeek publishes it: every projection FP8
    with 16x16 block scales (shapes not multiples of the block), router, norms,
    embeddings and LM head in full precision, quantization_config in
    config.json, and a multi-token-prediction layer after the last decoder
    layer. moefit eval (1 and 3 processes) equals transformers on the
    dequantized weights; moefit export writes a plain model transformers loads
    with the same logits."""
    model = make_model("deepseek_v3", tmp_path / "hf")
    block = [16, 16]
    tensors, reference = {}, {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        quantized = (t.dim() == 2 and name.endswith("_proj.weight") and "embed" not in name)
        if quantized:
            q, scale, deq = quantize_fp8(t.float(), block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            reference[name] = deq
        elif PACKED_EXPERTS.search(name):
            continue  # written per expert below
        else:
            tensors[name] = t
    # Routed experts per expert, quantized one by one.
    for name, t in model.state_dict().items():
        if not PACKED_EXPERTS.search(name):
            continue
        prefix = name.rsplit(".", 1)[0]
        deq_all = []
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):
                half = t.shape[1] // 2
                parts = {"gate_proj": t[e, :half], "up_proj": t[e, half:]}
            else:
                parts = {"down_proj": t[e]}
            deq_parts = []
            for proj, w in parts.items():
                q, scale, deq = quantize_fp8(w.float().contiguous(), block)
                key = f"{prefix}.{e}.{proj}.weight"
                tensors[key], tensors[key + "_scale_inv"] = q, scale
                deq_parts.append(deq)
            deq_all.append(torch.cat(deq_parts, 0))
        reference[name] = torch.stack(deq_all)
    # The MTP module, stored as layer num_hidden_layers (3): never loaded.
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    tensors["model.layers.3.enorm.weight"] = torch.ones(64)
    tensors["model.layers.3.shared_head.head.weight"] = torch.randn(300, 64)
    quantized_names = [k[:-len("_scale_inv")] for k in tensors if k.endswith("_scale_inv")]
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, fp8_dir / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                     "quant_method": "fp8", "weight_block_size": block}
    config["num_nextn_predict_layers"] = 1
    (fp8_dir / "config.json").write_text(json.dumps(config))

    model.load_state_dict(reference, strict=False)
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()
    for np in (1, 3):
        got = moefit_logits(build_dir, fp8_dir, ids, tmp_path, np=np)
        err = (got - expected).abs().max().item()
        assert err < TOLERANCE, f"np={np}: max |logit difference| {err:.3g}"

    # By default an FP8 checkpoint exports to bfloat16, as DeepSeek's own
    # conversion does; in float32 the dequantized values are kept exactly.
    def written_tensors(d):
        return {k: t for f in d.glob("*.safetensors") for k, t in load_file(f).items()}

    moefit(build_dir, "export", fp8_dir, tmp_path / "bf16", np=2)
    written = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in written and written["torch_dtype"] == "bfloat16"
    assert written["num_nextn_predict_layers"] == 0
    tensors = written_tensors(tmp_path / "bf16")
    assert not any(k.startswith("model.layers.3.") for k in tensors)  # the MTP layer is not kept
    for name in quantized_names:  # FP8 weights come out bfloat16, the rest as stored
        assert tensors[name].dtype == torch.bfloat16, name
    # A bfloat16 save keeps the router float32, as transformers does: rounding
    # the correction bias would change which experts are picked.
    moefit(build_dir, "export", fp8_dir, tmp_path / "all_bf16", "--save-dtype", "bfloat16", np=2)
    for name, t in written_tensors(tmp_path / "all_bf16").items():
        router = name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias")
        assert t.dtype == (torch.float32 if router else torch.bfloat16), (name, t.dtype)
    moefit(build_dir, "export", fp8_dir, tmp_path / "out", "--save-dtype", "float32", np=2)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in written
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        err = (loaded(input_ids=ids).logits - expected).abs().max().item()
    assert err < TOLERANCE, f"exported: max |logit difference| {err:.3g}"


def test_kimi_k2_config_loads_as_deepseek_v3_and_saves_under_its_name(build_dir, tmp_path):
    """Kimi-K2's config.json names model_type kimi_k2 (served by its own code)
    and writes YaRN the old way, as rope_scaling. moefit reads it as
    deepseek_v3 (logits equal transformers' DeepseekV3 on the same weights),
    and a trained save keeps model_type kimi_k2 and the rope_scaling key its
    code reads."""
    model = make_model("deepseek_v3", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope.pop("rope_type")
    config["rope_scaling"] = dict(rope, type="yarn")
    config["model_type"] = "kimi_k2"
    config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()
    got = moefit_logits(build_dir, tmp_path / "hf", ids, tmp_path)
    assert (got - expected).abs().max().item() < TOLERANCE

    moefit(build_dir, "train", "--set", f"model.model_path={tmp_path / 'hf'}", "--set", "train.steps=2",
           "--set", "train.seq_len=32", "--set", "train.micro_batch_size=1", "--set",
           f"checkpoint.save_dir={tmp_path / 'trained'}", "--set", "logging.metrics_file=")
    written = json.loads((tmp_path / "trained" / "config.json").read_text())
    assert written["model_type"] == "kimi_k2" and written["architectures"] == ["DeepseekV3ForCausalLM"]
    assert written["rope_scaling"]["type"] == "yarn" and written["rope_scaling"]["factor"] == 4.0
    assert written["rope_scaling"]["mscale_all_dim"] == 0.8
    assert written["auto_map"] == config["auto_map"]
    # Its weights are a deepseek_v3 checkpoint transformers loads as such.
    written["model_type"] = "deepseek_v3"
    (tmp_path / "trained" / "config.json").write_text(json.dumps(written))
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
