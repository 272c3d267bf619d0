"""moefit's model against the Hugging Face transformers implementation.

For each family, a tiny model is built by transformers with random weights;
its weights (transformers v5 names, packed experts) and a batch of input ids
are written with safetensors, moefit computes the logits on the same weights,
and both must agree (fp32; 1e-4 absolute on logits of order 1: the two sum in
different orders, e.g. SDPA kernels and expert accumulation).
"""
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256)

FAMILIES = {
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1e6)),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1)),
    "mixtral": (MixtralForCausalLM, MixtralConfig(
        **COMMON, intermediate_size=32, num_local_experts=6, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("backend", ["grouped", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, backend, build_dir, tmp_path):
    cls, config = FAMILIES[family]
    torch.manual_seed(0)
    model = cls(config).eval()
    # Spread the router so that top-k choices are not near ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()

    config.to_json_file(tmp_path / "config.json")
    save_file({k: v.contiguous().clone() for k, v in model.state_dict().items()},
              tmp_path / "weights.safetensors")
    save_file({"input_ids": ids}, tmp_path / "inputs.safetensors")
    tool = build_dir / "tests/framework/reference_logits_tool"
    run = subprocess.run([str(tool), str(tmp_path / "config.json"), str(tmp_path / "weights.safetensors"),
                          str(tmp_path / "inputs.safetensors"), str(tmp_path / "out.safetensors"), backend],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = load_file(tmp_path / "out.safetensors")["logits"]
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    assert err < 1e-4, f"max |logit difference| {err:.3g} for {family}/{backend}"
