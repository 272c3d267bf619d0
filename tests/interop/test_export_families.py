"""The deepseek_v3 and glm4_moe mapping tables against transformers' own checkpoints.

A tiny model of each family is saved by transformers' save_pretrained (which
writes per-expert keys, the shared experts, the router's e_score_correction_bias
buffer, multi-head latent attention for deepseek_v3, q/k/v biases and q/k norms
for glm4_moe), loaded by moefit's LoadCheckpoint with the family's table and
exported again by SaveCheckpoint, through `safetensors_tool export`. The export
must hold exactly transformers' keys with the same values, so every key is
covered by a rule and every rule runs backwards to the key it came from.
"""

import glob
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM


def read_dir(path):
    tensors = {}
    for f in glob.glob(str(path / "*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def deepseek_v3(q_lora_rank):
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8))


def glm4_moe():
    return Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, use_qk_norm=True, attention_bias=True))


@pytest.mark.parametrize("family,make", [
    ("deepseek_v3", lambda: deepseek_v3(q_lora_rank=24)),
    ("deepseek_v3", lambda: deepseek_v3(q_lora_rank=None)),  # q_proj instead of q_a/q_b
    ("glm4_moe", glm4_moe),
])
def test_transformers_checkpoint_round_trips(tool, tmp_path, family, make):
    torch.manual_seed(0)
    model = make()
    model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    result = subprocess.run([str(tool), "export", str(tmp_path / "hf"), family, str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    original, exported = read_dir(tmp_path / "hf"), read_dir(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert any(".mlp.experts.7.down_proj.weight" in n for n in original)
    assert any(n.endswith("e_score_correction_bias") for n in original)
