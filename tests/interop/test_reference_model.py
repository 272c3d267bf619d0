"""moefit against Hugging Face transformers, through model directories.

For each family, a tiny model built by transformers with random weights is
saved with save_pretrained (per-expert checkpoint keys, sharded, with an
index). Then:
  * `moefit eval --save-logits` on that directory equals the transformers
    forward (fp32; 1e-4 absolute on logits of order 1: the implementations sum
    in different orders, e.g. SDPA kernels and expert accumulation), with both
    expert backends and at 1 and 2 processes;
  * a directory moefit writes (`moefit export`, and the end-of-training save
    of `moefit train`) loads with AutoModelForCausalLM.from_pretrained with no
    missing, unexpected or mismatched keys; the exported one gives the same
    logits, the trained one the logits moefit computes for it.
"""
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

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
    for backend, np in [("grouped", 1), ("eager", 1), ("grouped", 2)]:
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


def test_trained_model_round_trips(build_dir, tmp_path):
    make_model("qwen2_moe", tmp_path / "hf")
    moefit(build_dir, "train", "--set", f"model.model_path={tmp_path / 'hf'}", "--set", "train.steps=3",
           "--set", "train.seq_len=32", "--set", "train.micro_batch_size=1", "--set",
           f"checkpoint.save_dir={tmp_path / 'trained'}", "--set", "logging.metrics_file=", np=2)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    changed = [n for n, p in loaded.named_parameters()
               if not torch.equal(p, original.state_dict()[n])]
    assert changed, "training changed no weight"
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        expected = loaded(input_ids=ids).logits
    got = moefit_logits(build_dir, tmp_path / "trained", ids, tmp_path)
    assert (got - expected).abs().max().item() < TOLERANCE
