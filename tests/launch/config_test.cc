// Config loading: defaults, the demo, --set overrides, HF config.json files of
// each family, and one test per kind of bad input with its exact message.
#include "launch/config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace moefit::launch {
namespace {

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

absl::StatusOr<RunConfig> Resolve(const std::string& path, const std::vector<std::string>& sets) {
  absl::StatusOr<proto::Config> c = LoadConfig(path, sets);
  if (!c.ok()) return c.status();
  return ResolveConfig(*c);
}

std::string ErrorOf(const std::string& path, const std::vector<std::string>& sets) {
  absl::StatusOr<RunConfig> r = Resolve(path, sets);
  EXPECT_FALSE(r.ok());
  return r.ok() ? "" : std::string(r.status().message());
}

TEST(Config, DemoResolves) {
  absl::StatusOr<RunConfig> r = Resolve("", {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model.model_type, "qwen3_moe");
  EXPECT_EQ(r->model.num_experts, 8);
  EXPECT_EQ(r->model.num_experts_per_tok, 2);
  EXPECT_TRUE(r->model.qk_norm);
  EXPECT_EQ(r->model.head_dim, 32);
  EXPECT_EQ(r->runtime.expert_backend, "grouped");
  EXPECT_EQ(r->data.format, "text");
}

TEST(Config, SetOverridesEveryKindOfField) {
  absl::StatusOr<RunConfig> r =
      Resolve("", {"optimizer.lr=1e-3", "train.steps=20", "experts.backend=eager",
                   "model.norm_topk_prob=false", "model.mlp_only_layers=[0, 2]",
                   "model.intermediate_size=64", "optimizer.weight_decay=0"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->train.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(r->train.optimizer.weight_decay, 0.0);
  EXPECT_EQ(r->train.steps, 20);
  EXPECT_EQ(r->runtime.expert_backend, "eager");
  EXPECT_FALSE(r->model.norm_topk_prob);
  EXPECT_EQ(r->model.mlp_only_layers, (std::vector<int64_t>{0, 2}));
  EXPECT_FALSE(r->model.IsMoeLayer(0));
  EXPECT_TRUE(r->model.IsMoeLayer(1));
}

TEST(Config, FileMergesOntoDefaults) {
  const std::string path = WriteTemp("ok.pbtxt", R"(
    model { model_type: "qwen3_moe" vocab_size: 300 hidden_size: 64 num_hidden_layers: 2
            num_attention_heads: 4 num_experts: 4 num_experts_per_tok: 2 moe_intermediate_size: 32 }
    train { steps: 3 }
  )");
  absl::StatusOr<RunConfig> r = Resolve(path, {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->train.steps, 3);
  EXPECT_EQ(r->train.micro_batch_size, 8);                 // default
  EXPECT_DOUBLE_EQ(r->train.optimizer.lr, 3e-4);           // default
  EXPECT_EQ(r->model.num_key_value_heads, 4);              // = num_attention_heads
  EXPECT_EQ(r->model.head_dim, 16);                        // = hidden / heads
  EXPECT_DOUBLE_EQ(r->model.router_aux_loss_coef, 0.001);  // qwen3_moe default
}

TEST(Config, Qwen3MoeConfigJson) {
  // Key names and layout of Qwen3-30B-A3B's config.json, shrunk.
  const std::string json = WriteTemp("qwen3.json", R"({
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 32, "norm_topk_prob": true, "num_attention_heads": 8,
    "num_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 3,
    "num_key_value_heads": 2, "output_router_logits": false, "rms_norm_eps": 1e-06,
    "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
    "vocab_size": 512})");
  absl::StatusOr<RunConfig> r =
      Resolve("", {"model.config_json=" + json, "model.num_hidden_layers=2"});
  ASSERT_TRUE(r.ok()) << r.status();
  // On the demo, config_json replaces the demo's model; --set still wins.
  EXPECT_EQ(r->model.num_hidden_layers, 2);
  EXPECT_EQ(r->model.hidden_size, 64);
  EXPECT_EQ(r->model.num_experts, 16);
  EXPECT_EQ(r->model.head_dim, 16);
  EXPECT_DOUBLE_EQ(r->model.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(r->model.rms_norm_eps, 1e-6);

  // In a config file, fields given there override the file's.
  const std::string cfg = WriteTemp(
      "q3.pbtxt", "model { config_json: \"" + json + "\" hidden_size: 128 head_dim: 32 }");
  r = Resolve(cfg, {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model.hidden_size, 128);
  EXPECT_EQ(r->model.num_hidden_layers, 3);
}

TEST(Config, FamiliesFromConfigJsonAlone) {
  const std::string qwen2 = WriteTemp("qwen2.json", R"({
    "model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": false, "vocab_size": 300,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": false})");
  const std::string cfg = WriteTemp("q2.pbtxt", "model { config_json: \"" + qwen2 + "\" }");
  absl::StatusOr<RunConfig> r = Resolve(cfg, {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model.model_type, "qwen2_moe");
  EXPECT_TRUE(r->model.attention_bias);
  EXPECT_FALSE(r->model.qk_norm);
  EXPECT_EQ(r->model.shared_expert_intermediate_size, 64);
  EXPECT_FALSE(r->model.IsMoeLayer(1));
  EXPECT_DOUBLE_EQ(r->model.rope_theta, 1e6);

  const std::string mixtral = WriteTemp("mixtral.json", R"({
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
    "intermediate_size": 112, "num_local_experts": 8, "num_experts_per_tok": 2,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "vocab_size": 320, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02, "sliding_window": null, "tie_word_embeddings": false})");
  const std::string cfg2 = WriteTemp("mx.pbtxt", "model { config_json: \"" + mixtral + "\" }");
  r = Resolve(cfg2, {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model.num_experts, 8);
  EXPECT_EQ(r->model.moe_intermediate_size, 112);
  EXPECT_TRUE(r->model.norm_topk_prob);
  EXPECT_DOUBLE_EQ(r->model.router_aux_loss_coef, 0.02);
  EXPECT_EQ(r->model.head_dim, 8);
}

// DeepSeek-V3's config.json as published (shrunk): old-style rope_scaling,
// FP8 quantization_config, n_routed_experts, remote-code keys; and the same
// architecture under Kimi-K2's model_type.
constexpr char kDeepseekJson[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
  "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 1,
  "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
  "kv_lora_rank": 16, "max_position_embeddings": 1024, "model_type": "MODEL_TYPE",
  "moe_intermediate_size": 32, "moe_layer_freq": 1, "n_group": 4, "n_routed_experts": 16,
  "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 4,
  "num_experts_per_tok": 4, "num_hidden_layers": 3, "num_key_value_heads": 4,
  "num_nextn_predict_layers": 1, "q_lora_rank": Q_LORA, "qk_nope_head_dim": 16,
  "qk_rope_head_dim": 8,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
  "tie_word_embeddings": false, "topk_group": 2, "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": true,
  "v_head_dim": 16, "vocab_size": 300})";

// `text` with the first `from` replaced by `to` (which must be there).
std::string ReplaceFirst(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? text : text.substr(0, at) + to + text.substr(at + from.size());
}

std::string DeepseekJson(const std::string& name, const std::string& model_type,
                         const std::string& q_lora) {
  return WriteTemp(
      name, ReplaceFirst(ReplaceFirst(kDeepseekJson, "MODEL_TYPE", model_type), "Q_LORA", q_lora));
}

TEST(Config, DeepseekV3AndKimiK2ConfigJson) {
  for (const std::string model_type : {"deepseek_v3", "kimi_k2"}) {
    absl::StatusOr<RunConfig> r =
        Resolve("", {"model.config_json=" + DeepseekJson("ds.json", model_type, "24")});
    ASSERT_TRUE(r.ok()) << r.status();
    const framework::ModelOptions& m = r->model;
    EXPECT_EQ(m.model_type, "deepseek_v3");
    EXPECT_EQ(m.hf_model_type, model_type == "kimi_k2" ? "kimi_k2" : "");
    EXPECT_EQ(m.attention, framework::AttentionKind::kMla);
    EXPECT_EQ(m.num_experts, 16);
    EXPECT_EQ(m.q_lora_rank, 24);
    EXPECT_EQ(m.qk_head_dim(), 24);
    EXPECT_EQ(m.scoring, framework::RouterScoring::kSigmoid);
    EXPECT_TRUE(m.correction_bias);
    EXPECT_EQ(m.n_group, 4);
    EXPECT_EQ(m.topk_group, 2);
    EXPECT_DOUBLE_EQ(m.routed_scaling_factor, 2.5);
    EXPECT_EQ(m.n_shared_experts, 1);
    EXPECT_FALSE(m.IsMoeLayer(0));
    EXPECT_TRUE(m.IsMoeLayer(1));
    EXPECT_DOUBLE_EQ(m.aux_loss_alpha, 0.001);
    EXPECT_DOUBLE_EQ(m.router_aux_loss_coef, 0.0);
    EXPECT_EQ(m.num_nextn_predict_layers, 1);
    EXPECT_EQ(m.rope_scaling.type, "yarn");
    EXPECT_DOUBLE_EQ(m.rope_scaling.factor, 40);
    EXPECT_EQ(m.rope_scaling.original_max_position_embeddings, 4096);
    EXPECT_DOUBLE_EQ(m.rope_scaling.mscale_all_dim, 1.0);
    ASSERT_TRUE(m.fp8_weight_block.has_value());
    EXPECT_EQ((*m.fp8_weight_block)[0], 128);
  }
  // "q_lora_rank": null is no query compression, not the family default.
  absl::StatusOr<RunConfig> r =
      Resolve("", {"model.config_json=" + DeepseekJson("ds0.json", "deepseek_v3", "null")});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model.q_lora_rank, 0);
}

TEST(Config, Glm4MoeConfigJsonWithRopeParameters) {
  // transformers v5 layout: rope_theta and partial_rotary_factor under rope_parameters.
  const std::string json = WriteTemp("glm.json", R"({
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": true,
    "attention_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 1024,
    "moe_intermediate_size": 32, "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1,
    "norm_topk_prob": true, "num_attention_heads": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 3, "num_key_value_heads": 2, "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.5, "topk_group": 1, "use_qk_norm": true,
    "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": false, "vocab_size": 300, "dtype": "bfloat16"})");
  absl::StatusOr<RunConfig> r = Resolve("", {"model.config_json=" + json});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model.model_type, "glm4_moe");
  EXPECT_DOUBLE_EQ(r->model.partial_rotary_factor, 0.5);
  EXPECT_EQ(r->model.rotary_dim(), 8);
  EXPECT_DOUBLE_EQ(r->model.rope_theta, 1e6);
  EXPECT_TRUE(r->model.qk_norm);
  EXPECT_TRUE(r->model.attention_bias);
  EXPECT_EQ(r->model.scoring, framework::RouterScoring::kSigmoid);
  EXPECT_EQ(r->model.rope_scaling.type, "default");
}

// The DeepSeek-V3 config.json above with one piece of text replaced.
std::string DeepseekJsonWith(const std::string& name, const std::string& from,
                             const std::string& to) {
  const std::string text =
      ReplaceFirst(ReplaceFirst(kDeepseekJson, "MODEL_TYPE", "deepseek_v3"), "Q_LORA", "24");
  return WriteTemp(name, ReplaceFirst(text, from, to));
}

TEST(ConfigErrors, ConfigJsonKeysAreUsedOrListed) {
  std::string path =
      DeepseekJsonWith("k1.json", R"("ep_size": 1)", R"("attn_logit_softcapping": 30.0)");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + path}),
            path +
                ": key \"attn_logit_softcapping\" = 30.0 is not read by moefit (neither a model "
                "field nor on the documented ignore list); remove it if it does not change the "
                "model");
  path = DeepseekJsonWith("k2.json", R"("silu")", R"("gelu")");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + path}),
            path +
                ": hidden_act = \"gelu\" is not supported: moefit's MLPs and experts are "
                "SwiGLU (silu)");
  path = DeepseekJsonWith("k3.json", R"("type": "yarn")", R"("type": "llama3")");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + path}),
            "model.rope_scaling type 'llama3' is not implemented by moefit (default or yarn)");
  path = DeepseekJsonWith("k4.json", R"("quant_method": "fp8")", R"("quant_method": "gptq")");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + path}),
            "model.quantization_config.quant_method = 'gptq' is not supported (moefit reads fp8 "
            "block-scaled and compressed-tensors checkpoints)");
  path = DeepseekJsonWith("k6.json", R"("seq_aux": true)", R"("seq_aux": false)");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + path}),
            "model.seq_aux = false: moefit implements only the sequence-wise balance loss of "
            "aux_loss_alpha");
  path = WriteTemp("k5.json", R"({"model_type": "mixtral", "sliding_window": 4096})");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + path}),
            path +
                ": sliding_window = 4096 is not supported: moefit has no sliding-window "
                "attention (set it to null)");
}

// The quantization_config of DeepSeek-V3's config.json above, as it is in the file.
constexpr char kFp8QuantizationConfig[] =
    R"("quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]})";

// Kimi-K2-Thinking's group: int4 routed experts in groups of 32, as its
// config.json writes it (the library's QuantizationArgs dump).
constexpr char kKimiThinkingGroup[] = R"({
      "input_activations": null, "output_activations": null, "targets": ["Linear"],
      "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": 32,
                  "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                  "symmetric": true, "type": "int"}})";

// DeepSeek-V3's config.json above with a compressed-tensors
// quantization_config: `groups` (the config_groups object's inside) and the
// top-level `format`, plus any `extra` top-level keys.
std::string CompressedTensorsJson(const std::string& name, const std::string& groups,
                                  const std::string& format = "pack-quantized",
                                  const std::string& extra = "") {
  return DeepseekJsonWith(
      name, kFp8QuantizationConfig,
      R"("quantization_config": {"config_groups": {)" + groups + R"(}, "format": ")" + format +
          R"(", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
              "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"], "kv_cache_scheme": null,
              "quant_method": "compressed-tensors", "quantization_status": "compressed")" +
          extra + "}");
}

std::string KimiThinkingJson(const std::string& name, const std::string& from = "",
                             const std::string& to = "", const std::string& extra = "") {
  const std::string group =
      from.empty() ? kKimiThinkingGroup : ReplaceFirst(kKimiThinkingGroup, from, to);
  return CompressedTensorsJson(name, R"("group_0": )" + group, "pack-quantized", extra);
}

TEST(Config, CompressedTensorsInt4AndFp8Blocks) {
  absl::StatusOr<RunConfig> r = Resolve("", {"model.config_json=" + KimiThinkingJson("ct1.json")});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->model.int4_weights.has_value());
  EXPECT_EQ(r->model.int4_weights->group_size, 32);
  EXPECT_TRUE(r->model.int4_weights->symmetric);
  EXPECT_FALSE(r->model.fp8_weight_block.has_value());
  EXPECT_EQ(r->model.fp8_scale_suffix, "_scale_inv");

  // Asymmetric, groups of 128, the zero points' dtype named.
  const std::string asymmetric =
      ReplaceFirst(ReplaceFirst(kKimiThinkingGroup, R"("group_size": 32)", R"("group_size": 128)"),
                   R"("symmetric": true)", R"("symmetric": false, "zp_dtype": "torch.int8")");
  r = Resolve("", {"model.config_json=" +
                   CompressedTensorsJson("ct2.json", R"("group_0": )" + asymmetric)});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->model.int4_weights.has_value());
  EXPECT_EQ(r->model.int4_weights->group_size, 128);
  EXPECT_FALSE(r->model.int4_weights->symmetric);

  // llm-compressor's FP8 blocks: the DeepSeek FP8 path, scales named X_scale.
  const std::string fp8_group = R"("group_0": {"input_activations": null,
      "output_activations": null, "targets": ["Linear"], "format": "float-quantized",
      "weights": {"num_bits": 8, "type": "float", "symmetric": true, "group_size": null,
                  "strategy": "block", "block_structure": [128, 64], "dynamic": false}})";
  r = Resolve(
      "", {"model.config_json=" + CompressedTensorsJson("ct3.json", fp8_group, "float-quantized")});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->model.fp8_weight_block.has_value());
  EXPECT_EQ((*r->model.fp8_weight_block)[0], 128);
  EXPECT_EQ((*r->model.fp8_weight_block)[1], 64);
  EXPECT_EQ(r->model.fp8_scale_suffix, "_scale");
  EXPECT_FALSE(r->model.int4_weights.has_value());

  // Both, each group with its own format.
  r = Resolve("",
              {"model.config_json=" +
               CompressedTensorsJson("ct4.json",
                                     fp8_group + R"(, "group_1": )" +
                                         ReplaceFirst(kKimiThinkingGroup, R"("targets")",
                                                      R"("format": "pack-quantized", "targets")"),
                                     "mixed-precision")});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->model.fp8_weight_block.has_value());
  EXPECT_TRUE(r->model.int4_weights.has_value());
}

TEST(ConfigErrors, CompressedTensorsSchemesMoefitDoesNotReadAreNamed) {
  const std::string weights = "model.quantization_config.config_groups.group_0.weights";
  struct Case {
    std::string from, to, extra, message;
  };
  const std::vector<Case> cases = {
      {R"("num_bits": 4)", R"("num_bits": 8)", "",
       weights + ".num_bits = 8: pack-quantized weights are read as 4-bit integers"},
      {R"("type": "int")", R"("type": "float")", "",
       weights + ".type = 'float': pack-quantized weights are read as integers (int)"},
      {R"("strategy": "group")", R"("strategy": "channel")", "",
       weights + ".strategy = 'channel': pack-quantized int4 is read with one scale per group of "
                 "inputs (group)"},
      {R"("group_size": 32)", R"("group_size": null)", "",
       weights + ".group_size = null: strategy group needs a positive group size"},
      {R"("dynamic": false)", R"("dynamic": true)", "",
       weights + ".dynamic = true: dynamic quantization stores no quantized weights; moefit "
                 "reads static ones (false)"},
      {R"("actorder": null)", R"("actorder": "group")", "",
       weights + ".actorder = \"group\": this activation order stores permuted columns "
                 "(weight_g_idx), which moefit does not read (null, \"weight\" or \"static\")"},
      {R"("symmetric": true)", R"("symmetric": false, "zp_dtype": "torch.float16")", "",
       weights + ".zp_dtype = 'torch.float16': pack-quantized zero points are packed 4-bit "
                 "integers (torch.int8)"},
      {R"("observer": "minmax")", R"("observer": "minmax", "scale_dtype": "torch.float8_e4m3fn")",
       "",
       weights + ".scale_dtype = 'torch.float8_e4m3fn': moefit reads scales in torch.bfloat16, "
                 "torch.float16 or torch.float32"},
      {R"("input_activations": null)",
       R"("input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                "dynamic": true})",
       "",
       "model.quantization_config.config_groups.group_0.input_activations is set: moefit reads "
       "weight-only quantization (it must be null)"},
      {R"("targets")", R"("format": "nvfp4-pack-quantized", "targets")", "",
       "model.quantization_config.config_groups.group_0.format = 'nvfp4-pack-quantized': moefit "
       "reads compressed-tensors' pack-quantized (int4) and float-quantized (FP8 blocks) "
       "formats"},
      {"", "", R"(, "quantization_status": "frozen")",
       "model.quantization_config.quantization_status = 'frozen': moefit reads checkpoints "
       "stored compressed (\"compressed\")"},
      {"", "", R"(, "transform_config": {"config_groups": {"u": {"type": "hadamard"}}})",
       R"(model.quantization_config.transform_config = {"config_groups":{"u":{"type":"hadamard"}}}: )"
       "moefit reads quantized weights as stored, without sparsity, transforms or pruned "
       "experts"},
  };
  for (size_t case_idx = 0; case_idx < cases.size(); ++case_idx) {
    const Case& c = cases[case_idx];
    SCOPED_TRACE(c.message);
    const std::string path =
        KimiThinkingJson("cte" + std::to_string(case_idx) + ".json", c.from, c.to, c.extra);
    EXPECT_EQ(ErrorOf("", {"model.config_json=" + path}), c.message);
  }
  // The last key wins in a JSON object: these replace the file's.
  EXPECT_EQ(
      ErrorOf("", {"model.config_json=" +
                   KimiThinkingJson("cte_kv.json", "", "",
                                    R"(, "kv_cache_scheme": {"num_bits": 8, "type": "float"})")}),
      "model.quantization_config.kv_cache_scheme is set: moefit does not quantize the "
      "attention's keys and values (it must be null)");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + CompressedTensorsJson("cte_empty.json", "")}),
            "model.quantization_config.config_groups is empty: no quantized weights to read");
  // Two int4 groups that disagree.
  EXPECT_EQ(
      ErrorOf("", {"model.config_json=" +
                   CompressedTensorsJson("cte_two.json",
                                         R"("group_0": )" + std::string(kKimiThinkingGroup) +
                                             R"(, "group_1": )" +
                                             ReplaceFirst(kKimiThinkingGroup, R"("group_size": 32)",
                                                          R"("group_size": 128)"))}),
      "model.quantization_config.config_groups.group_1: int4 in groups of 128, symmetric, but "
      "config_groups.group_0 is in groups of 32, symmetric: moefit reads one pack-quantized "
      "scheme per checkpoint");
  // FP8 blocks of three sizes.
  EXPECT_EQ(ErrorOf("", {"model.config_json=" +
                         CompressedTensorsJson("cte_fp8.json", R"("group_0": {"targets": ["Linear"],
      "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                  "block_structure": [128, 128, 1]}})",
                                               "float-quantized")}),
            weights + ".block_structure = [128, 128, 1]: must be two positive sizes [rows, cols]");
}

TEST(Config, CollectiveDeadlines) {
  absl::StatusOr<RunConfig> defaults = Resolve("", {});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_DOUBLE_EQ(defaults->timeout_s, 300);
  EXPECT_DOUBLE_EQ(defaults->startup_timeout_s, 1800);
  absl::StatusOr<RunConfig> set =
      Resolve("", {"parallel.timeout_s=2.5", "parallel.startup_timeout_s=60"});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_DOUBLE_EQ(set->timeout_s, 2.5);
  EXPECT_DOUBLE_EQ(set->startup_timeout_s, 60);
  // What every rank compares at start-up: the resolved config, overrides included.
  EXPECT_NE(set->config_text.find("timeout_s: 2.5"), std::string::npos) << set->config_text;
  EXPECT_EQ(ErrorOf("", {"parallel.timeout_s=0"}),
            "parallel.timeout_s = 0 must be a positive number of seconds");
  EXPECT_EQ(ErrorOf("", {"parallel.startup_timeout_s=-5"}),
            "parallel.startup_timeout_s = -5 must be a positive number of seconds");
}

TEST(Config, PackedWeightBudget) {
  absl::StatusOr<RunConfig> defaults = Resolve("", {});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->runtime.expert_packed_bytes, int64_t{2} << 30);
  absl::StatusOr<RunConfig> set = Resolve("", {"experts.packed_weight_gb=0.5"});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->runtime.expert_packed_bytes, int64_t{512} << 20);
  absl::StatusOr<RunConfig> none = Resolve("", {"experts.packed_weight_gb=0"});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->runtime.expert_packed_bytes, 0);
  // The value as given, and as the message prints it.
  for (const auto& [bad, printed] : {std::pair<const char*, const char*>{"-1", "-1"},
                                     {"nan", "nan"},
                                     {"inf", "inf"},
                                     {"2e6", "2e+06"}}) {
    EXPECT_EQ(ErrorOf("", {std::string("experts.packed_weight_gb=") + bad}),
              std::string("experts.packed_weight_gb = ") + printed +
                  " must be between 0 and 1048576 (GiB; 0: pack on every call)");
  }
}

TEST(Config, ExpertThreadPool) {
  absl::StatusOr<RunConfig> defaults = Resolve("", {});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->runtime.expert_thread_pool, experts::ThreadPool::kOpenMp);
  absl::StatusOr<RunConfig> tbb = Resolve("", {"experts.thread_pool=onetbb"});
  ASSERT_TRUE(tbb.ok()) << tbb.status();
  EXPECT_EQ(tbb->runtime.expert_thread_pool, experts::ThreadPool::kOneTbb);
  EXPECT_EQ(ErrorOf("", {"experts.thread_pool=tbb"}),
            "experts.thread_pool = 'tbb' must be openmp or onetbb (or empty)");
}

TEST(Config, DispatchPipelineAndProgressThread) {
  absl::StatusOr<RunConfig> defaults = Resolve("", {});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->runtime.dispatch_chunks, 1);
  EXPECT_EQ(defaults->progress_thread_us, 0);
  absl::StatusOr<RunConfig> set =
      Resolve("", {"parallel.dispatch_chunks=3", "parallel.progress_thread_us=100"});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->runtime.dispatch_chunks, 3);
  EXPECT_EQ(set->progress_thread_us, 100);
  EXPECT_EQ(ErrorOf("", {"parallel.dispatch_chunks=0"}),
            "parallel.dispatch_chunks = 0 must be >= 1");
  EXPECT_EQ(ErrorOf("", {"parallel.progress_thread_us=-1"}),
            "parallel.progress_thread_us = -1 must be >= 0 (0: no progress thread)");
}

TEST(ConfigErrors, RouterSettings) {
  const std::vector<std::string> ds = {"model.model_type=deepseek_v3",
                                       "model.q_lora_rank=16",
                                       "model.kv_lora_rank=16",
                                       "model.qk_nope_head_dim=8",
                                       "model.qk_rope_head_dim=8",
                                       "model.v_head_dim=8",
                                       "model.n_group=4",
                                       "model.topk_group=2"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = ds;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  // The demo sets router_aux_loss_coef 0.01: a Switch loss needs softmax scores.
  EXPECT_EQ(ErrorOf("", ds),
            "model.router_aux_loss_coef: the Switch balance loss needs softmax scores; sigmoid "
            "routers use model.aux_loss_alpha (sequence-wise) and the correction bias");
  EXPECT_EQ(ErrorOf("", with({"model.router_aux_loss_coef=0", "model.n_group=3"})),
            "model.num_experts = 8 is not divisible by model.n_group = 3");
  EXPECT_EQ(
      ErrorOf("", with({"model.router_aux_loss_coef=0", "model.n_group=8", "model.topk_group=1"})),
      "model.n_group = 8 leaves 1 expert per group; a group's score is its best two experts");
  EXPECT_EQ(
      ErrorOf("", with({"model.router_aux_loss_coef=0", "model.n_group=4", "model.topk_group=5"})),
      "model.topk_group = 5 exceeds model.n_group = 4");
  EXPECT_EQ(ErrorOf("", with({"model.router_aux_loss_coef=0", "model.n_group=4",
                              "model.topk_group=1", "model.num_experts_per_tok=3"})),
            "model.num_experts_per_tok = 3 exceeds the 2 experts of the model.topk_group = 1 "
            "groups a token may use");
  EXPECT_EQ(ErrorOf("", with({"model.router_aux_loss_coef=0", "model.scoring_func=softmax"})),
            "model.scoring_func = 'softmax' is not supported for deepseek_v3 (its router scores "
            "with a sigmoid)");
  EXPECT_EQ(ErrorOf("", with({"model.router_aux_loss_coef=0", "model.topk_method=greedy"})),
            "model.topk_method = 'greedy' is not supported for deepseek_v3 (its router is "
            "noaux_tc: correction bias and groups)");
  EXPECT_EQ(ErrorOf("", with({"model.router_aux_loss_coef=0", "model.moe_layer_freq=2"})),
            "model.moe_layer_freq = 2 is not supported: experts are in every layer from "
            "first_k_dense_replace on (as transformers builds these models)");
  EXPECT_EQ(ErrorOf("", {"model.n_group=2"}),
            "model.n_group, topk_group and routed_scaling_factor apply to the sigmoid routers of "
            "deepseek_v3 and glm4_moe, not to qwen3_moe");
  EXPECT_EQ(ErrorOf("", {"model.aux_loss_alpha=0.01"}),
            "model.aux_loss_alpha is the sequence-wise loss of sigmoid routers; qwen3_moe uses "
            "model.router_aux_loss_coef");
  EXPECT_EQ(ErrorOf("", with({"model.router_aux_loss_coef=0", "model.rope_scaling.rope_type=yarn",
                              "model.rope_scaling.beta_fast=-1"})),
            "model.rope_scaling.beta_fast = -1 and beta_slow = 1 must be positive");
  EXPECT_EQ(ErrorOf("", with({"model.router_aux_loss_coef=0", "model.qk_rope_head_dim=7"})),
            "model.qk_rope_head_dim = 7 must be even (rotary embedding)");
  EXPECT_EQ(ErrorOf("", with({"model.router_aux_loss_coef=0", "router.bias_update_rate=-1"})),
            "router.bias_update_rate = -1 must be >= 0");
  EXPECT_EQ(ErrorOf("", {"model.partial_rotary_factor=0.3"}),
            "model.head_dim = 32 with partial_rotary_factor 0.3 gives 9 rotary dims; they must be "
            "even and positive");
}

TEST(ConfigErrors, UnknownFieldInFile) {
  const std::string path = WriteTemp("bad1.pbtxt", "train {\n  stepz: 3\n}\n");
  EXPECT_EQ(ErrorOf(path, {}),
            path + ":2:8: Message type \"moefit.proto.TrainConfig\" has no field named \"stepz\".");
}

TEST(ConfigErrors, WrongTypeInFile) {
  const std::string path = WriteTemp("bad2.pbtxt", "optimizer { lr: \"fast\" }\n");
  EXPECT_EQ(ErrorOf(path, {}), path + ":1:17: Expected double, got: \"fast\"");
}

TEST(ConfigErrors, MissingFile) {
  EXPECT_EQ(ErrorOf("/nonexistent/x.pbtxt", {}), "config: cannot open '/nonexistent/x.pbtxt'");
  EXPECT_EQ(ErrorOf("", {"model.config_json=/nonexistent/config.json"}),
            "model.config_json: cannot open '/nonexistent/config.json'");
}

TEST(ConfigErrors, BadOverrides) {
  EXPECT_EQ(ErrorOf("", {"optimizer.lrr=1"}),
            "--set optimizer.lrr=1: unknown field 'lrr' in optimizer (fields: lr, weight_decay, "
            "beta1, beta2, eps, max_grad_norm, stochastic_rounding)");
  EXPECT_EQ(ErrorOf("", {"optimizer.lr=fast"}),
            "--set optimizer.lr=fast: 'fast' is not a valid double for optimizer.lr");
  EXPECT_EQ(ErrorOf("", {"train.steps"}),
            "--set 'train.steps': expected FIELD=VALUE, e.g. optimizer.lr=3e-4");
  EXPECT_EQ(ErrorOf("", {"train=3"}),
            "--set train=3: 'train' is a message; set one of its fields (steps, micro_batch_size, "
            "grad_accum_steps, seq_len, seed, mode, recompute, dense_dtype, allow_tf32)");
}

TEST(ConfigErrors, LoraSettings) {
  EXPECT_EQ(ErrorOf("", {"train.mode=qlora"}), "train.mode = 'qlora' must be full or lora");
  EXPECT_EQ(ErrorOf("", {"train.recompute=some"}),
            "train.recompute = 'some' must be none, experts or full");
  EXPECT_EQ(ErrorOf("", {"lora.rank=8"}),
            "lora.* is set but train.mode is not lora (set train.mode=lora)");
  EXPECT_EQ(ErrorOf("", {"train.mode=lora", "lora.target_modules=[q_proj]"}),
            "lora.rank = 0 must be positive");
  EXPECT_EQ(ErrorOf("", {"train.mode=lora", "lora.rank=8"}),
            "lora.target_modules is empty: name the modules to adapt (e.g. q_proj, v_proj, "
            "experts)");
  EXPECT_EQ(ErrorOf("", {"train.mode=lora", "lora.rank=8", "lora.target_modules=[q_proj]",
                         "lora.dropout=1"}),
            "lora.dropout = 1 must be in [0, 1)");
  EXPECT_EQ(ErrorOf("", {"train.mode=lora", "lora.rank=8", "lora.target_modules=[gate_proj]"}),
            "lora.target_modules: 'gate_proj' matches no module of this qwen3_moe model that "
            "LoRA can adapt (the routed experts are one fused module: target them as "
            "experts.gate_up_proj, experts.down_proj or experts); its modules: q_proj, k_proj, "
            "v_proj, o_proj, lm_head, experts, all-linear");
  EXPECT_EQ(ErrorOf("", {"train.mode=lora", "lora.rank=8", "lora.target_modules=[q_proj]",
                         "lora.base_dtype=fp8"}),
            "lora.base_dtype = 'fp8' must be float32 or bfloat16 (or empty)");
  EXPECT_EQ(ErrorOf("", {"train.mode=lora", "lora.rank=8", "lora.target_modules=[q_proj]",
                         "lora.adapter_path=/nonexistent"}),
            "/nonexistent/adapter_config.json: cannot open (not a PEFT adapter directory?)");
}

TEST(ConfigErrors, InconsistentShapes) {
  EXPECT_EQ(ErrorOf("", {"model.num_experts_per_tok=9"}),
            "model.num_experts_per_tok = 9 exceeds model.num_experts = 8");
  EXPECT_EQ(ErrorOf("", {"model.hidden_size=130", "model.head_dim=0"}),
            "model.head_dim = 0 must be positive");
  const std::string path = WriteTemp("bad3.pbtxt", R"(
    model { model_type: "qwen3_moe" vocab_size: 300 hidden_size: 100 num_hidden_layers: 2
            num_attention_heads: 3 num_experts: 4 num_experts_per_tok: 2 moe_intermediate_size: 32 })");
  EXPECT_EQ(ErrorOf(path, {}),
            "model.hidden_size = 100 is not divisible by model.num_attention_heads = 3");
  EXPECT_EQ(ErrorOf("", {"model.num_key_value_heads=3"}),
            "model.num_attention_heads = 4 is not divisible by model.num_key_value_heads = 3");
  EXPECT_EQ(ErrorOf("", {"model.mlp_only_layers=[7]"}),
            "model.mlp_only_layers holds 7, outside [0, 4)");
  EXPECT_EQ(ErrorOf("", {"model.model_type=llama"}),
            "model.model_type = 'llama' is not a supported family (supported: qwen3_moe, "
            "qwen2_moe, mixtral, deepseek_v3, glm4_moe)");
  EXPECT_EQ(ErrorOf("", {"model.vocab_size=100"}),
            "model.vocab_size = 100 is smaller than the byte tokenizer's 256 tokens "
            "(data.format = text)");
  EXPECT_EQ(ErrorOf("", {"experts.backend=fast"}),
            "experts.backend = 'fast' is unknown (known: grouped, eager)");
  EXPECT_EQ(ErrorOf("", {"experts.dtype=fp8"}),
            "experts.dtype = 'fp8' must be float32, bfloat16, float8_e4m3fn or int4 (or empty)");
  EXPECT_EQ(ErrorOf("", {"train.seq_len=4096"}),
            "train.seq_len = 4096 exceeds model.max_position_embeddings = 1024");
  EXPECT_EQ(ErrorOf("", {"optimizer.beta2=1"}), "optimizer.beta2 = 1 must be in [0, 1)");
  const std::string missing = WriteTemp("bad4.pbtxt", R"(model { model_type: "mixtral" })");
  EXPECT_EQ(ErrorOf(missing, {}),
            "model.vocab_size is not set (give it in the config or through model.config_json)");
}

TEST(ConfigErrors, BadConfigJson) {
  const std::string bad =
      WriteTemp("badtype.json", R"({"model_type": "qwen3_moe", "hidden_size": "big"})");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + bad}),
            bad + ": field hidden_size = \"big\" has the wrong type (int64 expected)");
  const std::string broken = WriteTemp("broken.json", "{\"model_type\": ");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + broken}), broken + ": not a JSON object");
}

}  // namespace
}  // namespace moefit::launch
