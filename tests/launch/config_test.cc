// Config loading: defaults, the demo, --set overrides, HF config.json files of
// each family, and one test per kind of bad input with its exact message.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "launch/config.h"

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
  EXPECT_EQ(r->train.micro_batch_size, 8);          // default
  EXPECT_DOUBLE_EQ(r->train.optimizer.lr, 3e-4);     // default
  EXPECT_EQ(r->model.num_key_value_heads, 4);        // = num_attention_heads
  EXPECT_EQ(r->model.head_dim, 16);                  // = hidden / heads
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
  const std::string cfg = WriteTemp("q3.pbtxt", "model { config_json: \"" + json +
                                                    "\" hidden_size: 128 head_dim: 32 }");
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
            "beta1, beta2, eps, max_grad_norm)");
  EXPECT_EQ(ErrorOf("", {"optimizer.lr=fast"}),
            "--set optimizer.lr=fast: 'fast' is not a valid double for optimizer.lr");
  EXPECT_EQ(ErrorOf("", {"train.steps"}),
            "--set 'train.steps': expected FIELD=VALUE, e.g. optimizer.lr=3e-4");
  EXPECT_EQ(ErrorOf("", {"train=3"}),
            "--set train=3: 'train' is a message; set one of its fields (steps, micro_batch_size, "
            "grad_accum_steps, seq_len, seed)");
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
            "qwen2_moe, mixtral)");
  EXPECT_EQ(ErrorOf("", {"model.vocab_size=100"}),
            "model.vocab_size = 100 is smaller than the byte tokenizer's 256 tokens "
            "(data.format = text)");
  EXPECT_EQ(ErrorOf("", {"experts.backend=fast"}),
            "experts.backend = 'fast' is unknown (known: grouped, eager)");
  EXPECT_EQ(ErrorOf("", {"experts.dtype=fp8"}), "experts.dtype = 'fp8' must be float32 or bfloat16");
  EXPECT_EQ(ErrorOf("", {"train.seq_len=4096"}),
            "train.seq_len = 4096 exceeds model.max_position_embeddings = 1024");
  EXPECT_EQ(ErrorOf("", {"optimizer.beta2=1"}), "optimizer.beta2 = 1 must be in [0, 1)");
  const std::string missing = WriteTemp("bad4.pbtxt", R"(model { model_type: "mixtral" })");
  EXPECT_EQ(ErrorOf(missing, {}),
            "model.vocab_size is not set (give it in the config or through model.config_json)");
}

TEST(ConfigErrors, BadConfigJson) {
  const std::string bad = WriteTemp("badtype.json", R"({"model_type": "qwen3_moe", "hidden_size": "big"})");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + bad}),
            bad + ": field hidden_size = \"big\" has the wrong type (int64 expected)");
  const std::string broken = WriteTemp("broken.json", "{\"model_type\": ");
  EXPECT_EQ(ErrorOf("", {"model.config_json=" + broken}), broken + ": not a JSON object");
}

}  // namespace
}  // namespace moefit::launch
