"""moefit's LoRA adapters against PEFT and transformers.

For a tiny model of each family (random weights, saved by transformers), moefit
trains a LoRA adapter on a frozen base (attention, dense MLPs or shared
experts, and every routed expert) under expert parallelism, and saves it as a
PEFT adapter directory. Then:
  * peft loads it onto the transformers model with no missing or unexpected
    adapter keys, every tensor as written, and its logits equal `moefit eval`
    with the adapter (fp32, 1e-4), at 1 and 2 processes;
  * `moefit merge` writes a model transformers loads alone (no missing,
    unexpected or mismatched keys) with the same logits, and the same weights
    as peft's merge_and_unload;
  * the per-expert layout (lora.save_per_expert) holds, for every expert, the
    same weight update as the fused one;
  * two processes train the same adapter as one (the same losses, the same
    tensors), and a run continued from a saved adapter (lora.init_from) starts
    where it ended.
"""
import json
import subprocess

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from test_reference_model import MPI_ENV, make_model, moefit, moefit_logits

TARGETS = {
    # A dense MLP in layer 1 (mlp_only_layers) is adapted through gate_proj etc.
    "qwen3_moe": "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,experts]",
    # The gated shared expert and its gate.
    "qwen2_moe": "[q_proj,v_proj,shared_expert.gate_proj,shared_expert.down_proj,"
                 "shared_expert_gate,experts.gate_up_proj]",
    # Latent attention's projections, the dense first layer, the shared expert.
    "deepseek_v3": "[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,"
                   "experts.down_proj,experts.gate_up_proj]",
}
TOLERANCE = 1e-4


LR = 2e-2


def train_adapter(build_dir, family, hf, out, *extra, np=2, steps=4):
    moefit(build_dir, "train", "--set", f"model.model_path={hf}", "--set", f"train.steps={steps}",
           "--set", "train.seq_len=32", "--set", "train.micro_batch_size=2",
           "--set", f"optimizer.lr={LR}", "--set", "schedule.warmup_steps=0",
           "--set", "train.mode=lora", "--set", "lora.rank=4", "--set", "lora.alpha=8",
           "--set", f"lora.target_modules={TARGETS[family]}",
           "--set", f"checkpoint.save_dir={out}", *extra, np=np)


def losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_adapter_loads_in_peft_with_moefits_logits(family, build_dir, tmp_path):
    base_model = make_model(family, tmp_path / "hf")
    train_adapter(build_dir, family, tmp_path / "hf", tmp_path / "adapter",
                  "--set", "lora.save_per_expert=true")
    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and t.abs().max() > 0 for k, t in written.items())

    peft_model = PeftModel.from_pretrained(base_model, tmp_path / "adapter").eval()
    expected_keys = get_peft_model_state_dict(peft_model)
    assert set(expected_keys) == set(written), (
        set(expected_keys) ^ set(written))  # no missing, no unexpected key
    for k, t in written.items():
        assert torch.equal(expected_keys[k], t), k

    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits.float()
    for np in (1, 2):
        got = moefit_logits(build_dir, tmp_path / "hf", ids, tmp_path,
                            "--set", f"lora.adapter_path={tmp_path / 'adapter'}", np=np)
        err = (got - expected).abs().max().item()
        assert err < TOLERANCE, f"{family} np={np}: max |logit difference| {err:.3g}"
    plain = moefit_logits(build_dir, tmp_path / "hf", ids, tmp_path)
    assert (plain - expected).abs().max().item() > 1e3 * TOLERANCE, "the adapter changed nothing"

    # One module per expert: gate and up share the fused A; every expert's
    # update B·A is the fused adapter's.
    per_expert = load_file(tmp_path / "adapter" / "per_expert" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "adapter" / "per_expert" / "adapter_config.json").read_text())
    assert config["target_parameters"] is None
    checked = 0
    prefix = "base_model.model.model.layers."
    for layer, moe_layer in enumerate(peft_model.base_model.model.model.layers):
        experts = getattr(moe_layer.mlp, "experts", None)
        if experts is None:
            continue
        for wrapper in [m for m in experts.modules() if type(m).__name__ == "ParamWrapper"]:
            delta = wrapper.get_delta_weight("default")  # [E, out, in]
            for e in range(delta.shape[0]):
                key = f"{prefix}{layer}.mlp.experts.{e}."
                if wrapper.parameter_name == "down_proj":
                    got = per_expert[key + "down_proj.lora_B.weight"] @ per_expert[
                        key + "down_proj.lora_A.weight"]
                else:
                    got = torch.cat([per_expert[key + f"{p}_proj.lora_B.weight"] @ per_expert[
                        key + f"{p}_proj.lora_A.weight"] for p in ("gate", "up")])
                scaling = wrapper.scaling["default"]
                assert torch.allclose(got * scaling, delta[e], atol=1e-6), (layer, e)
                checked += 1
    assert checked > 0

    # The merged model: transformers alone, the same function, peft's merge.
    moefit(build_dir, "merge", tmp_path / "hf", tmp_path / "adapter", tmp_path / "merged", np=2)
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        err = (merged(input_ids=ids).logits - expected).abs().max().item()
    assert err < TOLERANCE, f"{family} merged: max |logit difference| {err:.3g}"
    reference = peft_model.merge_and_unload().state_dict()
    for name, t in merged.state_dict().items():
        assert torch.allclose(t, reference[name], atol=1e-6, rtol=1e-5), name


def test_two_processes_train_the_adapter_of_one(build_dir, tmp_path):
    make_model("qwen3_moe", tmp_path / "hf")
    runs = {}
    for np in (1, 2):
        metrics = tmp_path / f"metrics{np}.jsonl"
        # The same global batch of 4 sequences: 4 on one rank, 2 on each of two.
        train_adapter(build_dir, "qwen3_moe", tmp_path / "hf", tmp_path / f"adapter{np}",
                      "--set", f"logging.metrics_file={metrics}",
                      "--set", f"train.micro_batch_size={4 // np}", np=np)
        runs[np] = (losses(metrics), load_file(tmp_path / f"adapter{np}" / "adapter_model.safetensors"))
    one, two = runs[1], runs[2]
    assert len(one[0]) == 4 and one[0] == pytest.approx(two[0], rel=1e-5)
    assert set(one[1]) == set(two[1])
    # Two processes sum the loss and the gradients in another order than one
    # does, so they differ by rounding, which AdamW's normalized steps carry
    # into the weights: allowed up to a thousandth of one step's size (lr).
    for k in one[1]:
        assert torch.allclose(one[1][k], two[1][k], atol=1e-3 * LR, rtol=1e-4), k

    # Continued from the saved adapter: its first loss is below the first run's
    # last (it starts where that run ended, not from B = 0).
    metrics = tmp_path / "continued.jsonl"
    moefit(build_dir, "train", "--set", f"model.model_path={tmp_path / 'hf'}", "--set", "train.steps=1",
           "--set", "train.seq_len=32", "--set", "train.micro_batch_size=4", "--set", "train.mode=lora",
           "--set", f"lora.init_from={tmp_path / 'adapter1'}", "--set", f"logging.metrics_file={metrics}")
    assert losses(metrics)[0] < one[0][0] - 0.01


def test_bad_adapters_are_named(build_dir, tmp_path):
    make_model("qwen3_moe", tmp_path / "hf")
    train_adapter(build_dir, "qwen3_moe", tmp_path / "hf", tmp_path / "adapter", np=1, steps=1)
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())

    def eval_with(adapter_dir, *extra):
        return subprocess.run([str(build_dir / "launch/moefit"), "eval", "--set",
                               f"model.model_path={tmp_path / 'hf'}", "--set",
                               f"lora.adapter_path={adapter_dir}", "--eval-sequences", "1", *extra],
                              capture_output=True, text=True, timeout=120, env=MPI_ENV)

    config_path.write_text(json.dumps(dict(config, use_dora=True)))
    run = eval_with(tmp_path / "adapter")
    assert run.returncode == 2 and "use_dora" in run.stderr and "adapter_config.json" in run.stderr
    config_path.write_text(json.dumps(config))
    run = eval_with(tmp_path / "adapter", "--set", "lora.rank=8")
    assert run.returncode == 2 and "lora.rank = 8" in run.stderr, run.stderr
    run = eval_with(tmp_path / "nowhere")
    assert run.returncode == 2 and "adapter_config.json" in run.stderr, run.stderr
    config_path.write_text(json.dumps(dict(config, exclude_modules=["q_proj"])))
    run = eval_with(tmp_path / "adapter")
    assert run.returncode == 2 and "exclude_modules" in run.stderr, run.stderr
    config_path.write_text(json.dumps(config))

    def train_with(*sets):
        args = [str(build_dir / "launch/moefit"), "train", "--set", f"model.model_path={tmp_path / 'hf'}",
                "--set", "train.steps=1", "--set", "logging.metrics_file="]
        for s in sets:
            args += ["--set", s]
        return subprocess.run(args, capture_output=True, text=True, timeout=120, env=MPI_ENV)

    run = train_with(f"lora.adapter_path={tmp_path / 'adapter'}")
    assert run.returncode == 2 and "lora.init_from" in run.stderr, run.stderr
    run = train_with("train.mode=lora", "lora.rank=4", "lora.target_modules=[q_proj]",
                     f"checkpoint.save_dir={tmp_path / 'hf'}")
    assert run.returncode == 2 and "checkpoint.save_dir" in run.stderr, run.stderr
    assert (tmp_path / "hf" / "config.json").exists()
    run = train_with("train.mode=lora", "lora.rank=4",
                     "lora.target_modules=[model.layers.0.mlp.experts]")
    assert run.returncode == 2 and "one layer's routed experts" in run.stderr, run.stderr


def test_float32_merge_of_a_bfloat16_base_rounds_once(build_dir, tmp_path):
    """A bfloat16 base merged with --save-dtype float32 keeps W + s·B·A in
    float32 (not rounded to bfloat16 first)."""
    model = make_model("qwen3_moe", tmp_path / "hf32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    train_adapter(build_dir, "qwen3_moe", tmp_path / "hf", tmp_path / "adapter", np=1, steps=2)
    moefit(build_dir, "merge", tmp_path / "hf", tmp_path / "adapter", tmp_path / "merged",
           "--save-dtype", "float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    reference = peft_model.merge_and_unload().state_dict()
    rounded = 0
    for name, t in merged.state_dict().items():
        assert t.dtype == torch.float32, name
        assert torch.allclose(t, reference[name], atol=1e-6, rtol=1e-5), name
        rounded += int(torch.equal(t, t.to(torch.bfloat16).float()))
    assert rounded < len(reference), "every merged weight is a bfloat16 value"
