// Attention variants in double precision: autograd gradients against central
// differences for multi-head latent attention (with and without the query
// bottleneck, YaRN active) and GQA with partial rotary; the interleaved rotary
// against its plain twin (de-interleave, then rotate halves); and parameter
// counts against the tensors the model builds, for every family.
#include "framework/attention.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <functional>
#include <vector>

#include "framework/model.h"
#include "launch/config.h"
#include "tests/framework/test_configs.h"

namespace moefit::framework {
namespace {

at::Tensor Random(std::vector<int64_t> shape, at::Generator& gen, double scale = 0.3) {
  return at::randn(shape, gen, at::kDouble) * scale;
}

// Checks d(loss)/d(t) for every element of each tensor in `inputs` against
// central differences; loss() reads the tensors as they are.
void ExpectGradientsMatch(const std::function<at::Tensor()>& loss, std::vector<at::Tensor> inputs) {
  for (at::Tensor& t : inputs) t.requires_grad_(true);
  loss().backward();
  for (size_t n = 0; n < inputs.size(); ++n) {
    EXPECT_LT(WorstCentralDifference(inputs[n], loss), 1e-7) << "input " << n;
  }
}

ModelOptions Mla(int64_t q_lora_rank, bool yarn) {
  ModelOptions o;
  o.attention = AttentionKind::kMla;
  o.hidden_size = 12;
  o.num_attention_heads = 2;
  o.num_key_value_heads = 2;
  o.q_lora_rank = q_lora_rank;
  o.kv_lora_rank = 6;
  o.qk_nope_head_dim = 4;
  o.qk_rope_head_dim = 4;
  o.v_head_dim = 3;
  o.head_dim = 4;
  o.max_position_embeddings = 64;
  if (yarn) {
    o.rope_scaling.type = "yarn";
    o.rope_scaling.factor = 4;
    o.rope_scaling.original_max_position_embeddings = 16;
    o.rope_scaling.mscale = 1;
    o.rope_scaling.mscale_all_dim = 0.7;
  }
  return o;
}

RotaryTables DoubleTables(const ModelOptions& o, int64_t t) {
  RotaryTables r = ComputeRotaryTables(o, t, c10::kCPU);
  r.cos = r.cos.to(at::kDouble);
  r.sin = r.sin.to(at::kDouble);
  return r;
}

class LatentAttentionGradient : public ::testing::TestWithParam<std::pair<int64_t, bool>> {};

TEST_P(LatentAttentionGradient, MatchesFiniteDifferences) {
  const ModelOptions o = Mla(GetParam().first, GetParam().second);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const int64_t b = 2, t = 5, h = o.hidden_size, heads = o.num_attention_heads;
  LatentWeights w;
  if (o.q_lora_rank > 0) {
    w.q_a_proj = Random({o.q_lora_rank, h}, gen);
    w.q_a_norm = 1 + Random({o.q_lora_rank}, gen, 0.1);
    w.q_b_proj = Random({heads * o.qk_head_dim(), o.q_lora_rank}, gen);
  } else {
    w.q_proj = Random({heads * o.qk_head_dim(), h}, gen);
  }
  w.kv_a_proj = Random({o.kv_lora_rank + o.qk_rope_head_dim, h}, gen);
  w.kv_a_norm = 1 + Random({o.kv_lora_rank}, gen, 0.1);
  w.kv_b_proj = Random({heads * (o.qk_nope_head_dim + o.v_head_dim), o.kv_lora_rank}, gen);
  w.o_proj = Random({h, heads * o.v_head_dim}, gen);
  at::Tensor x = Random({b, t, h}, gen, 1.0);
  at::Tensor probe = Random({b, t, h}, gen, 1.0);
  const RotaryTables rope = DoubleTables(o, t);
  auto loss = [&] { return (LatentAttention(o, w, x, rope) * probe).sum(); };
  std::vector<at::Tensor> inputs = {x, w.kv_a_proj, w.kv_a_norm, w.kv_b_proj, w.o_proj};
  if (o.q_lora_rank > 0) {
    inputs.insert(inputs.end(), {w.q_a_proj, w.q_a_norm, w.q_b_proj});
  } else {
    inputs.push_back(w.q_proj);
  }
  ExpectGradientsMatch(loss, inputs);
}

INSTANTIATE_TEST_SUITE_P(All, LatentAttentionGradient,
                         ::testing::Values(std::make_pair(int64_t{5}, true),
                                           std::make_pair(int64_t{0}, false)),
                         [](const auto& info) {
                           return std::string(info.param.first > 0 ? "QLora" : "NoQLora") +
                                  (info.param.second ? "Yarn" : "Default");
                         });

TEST(GqaAttention, PartialRotaryGradientMatchesFiniteDifferences) {
  ModelOptions o;
  o.hidden_size = 8;
  o.num_attention_heads = 4;
  o.num_key_value_heads = 2;
  o.head_dim = 4;
  o.partial_rotary_factor = 0.5;
  o.attention_bias = true;
  o.qk_norm = true;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  GqaWeights w;
  w.q_proj = Random({16, 8}, gen);
  w.k_proj = Random({8, 8}, gen);
  w.v_proj = Random({8, 8}, gen);
  w.o_proj = Random({8, 16}, gen);
  w.q_bias = Random({16}, gen);
  w.k_bias = Random({8}, gen);
  w.v_bias = Random({8}, gen);
  w.q_norm = 1 + Random({4}, gen, 0.1);
  w.k_norm = 1 + Random({4}, gen, 0.1);
  at::Tensor x = Random({1, 4, 8}, gen, 1.0), probe = Random({1, 4, 8}, gen, 1.0);
  const RotaryTables rope = DoubleTables(o, 4);
  ASSERT_EQ(rope.cos.size(-1), 2);  // half of each head rotates
  ExpectGradientsMatch([&] { return (GqaAttention(o, w, x, rope) * probe).sum(); },
                       {x, w.q_proj, w.k_proj, w.v_bias, w.q_norm});
}

TEST(LatentAttention, InterleavedRotaryEqualsDeinterleavedPlainRotary) {
  // DeepSeek stores the rotary dims as pairs (x0, x1), (x2, x3), ...; rotating
  // them in place must equal moving the even dims first, the odd dims second,
  // and applying the plain rotate-half RoPE: checked through the whole
  // attention by permuting the rope rows of the projections instead.
  ModelOptions o = Mla(0, false);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const int64_t h = o.hidden_size, heads = o.num_attention_heads, nope = o.qk_nope_head_dim;
  const int64_t rope_dim = o.qk_rope_head_dim;
  LatentWeights w;
  w.q_proj = Random({heads * o.qk_head_dim(), h}, gen);
  w.kv_a_proj = Random({o.kv_lora_rank + rope_dim, h}, gen);
  w.kv_a_norm = 1 + Random({o.kv_lora_rank}, gen, 0.1);
  w.kv_b_proj = Random({heads * (nope + o.v_head_dim), o.kv_lora_rank}, gen);
  w.o_proj = Random({h, heads * o.v_head_dim}, gen);
  at::Tensor x = Random({1, 6, h}, gen, 1.0);
  const RotaryTables rope = DoubleTables(o, 6);
  at::Tensor interleaved = LatentAttention(o, w, x, rope);

  // Even rope dims first, then odd ones, in every head's q rows and in the rope key rows.
  std::vector<int64_t> order;
  for (int64_t i = 0; i < rope_dim; i += 2) order.push_back(i);
  for (int64_t i = 1; i < rope_dim; i += 2) order.push_back(i);
  LatentWeights p = w;
  p.q_proj = w.q_proj.clone();
  for (int64_t head = 0; head < heads; ++head) {
    const int64_t base = head * o.qk_head_dim() + nope;
    for (int64_t i = 0; i < rope_dim; ++i) p.q_proj[base + i] = w.q_proj[base + order[i]];
  }
  p.kv_a_proj = w.kv_a_proj.clone();
  for (int64_t i = 0; i < rope_dim; ++i) {
    p.kv_a_proj[o.kv_lora_rank + i] = w.kv_a_proj[o.kv_lora_rank + order[i]];
  }
  ModelOptions plain = o;
  plain.rope_interleave = false;
  at::Tensor reference = LatentAttention(plain, p, x, rope);
  EXPECT_LT((interleaved - reference).abs().max().item<double>(), 1e-12);
}

// RMSNorm of float32 host tensors runs fused (one pass forward, one back);
// the composite form, in float64, is its slow twin: the output and both
// gradients agree to float32 rounding, with rows not a multiple of any vector
// width, several leading dimensions, a strided (transposed) input, and a
// frozen weight or input.
TEST(RmsNorm, FusedFloat32EqualsTheCompositeInFloat64) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{3, 5, 37}, {2, 4, 8, 64}, {1, 3}, {300, 512}}) {
    for (const bool frozen_weight : {false, true}) {
      for (const bool frozen_input : {false, true}) {
        const int64_t h = shape.back();
        // The 4-d input is a transposed view, as a narrowed or transposed
        // activation reaches the norm.
        const bool strided = shape.size() == 4;
        std::vector<int64_t> stored = shape;
        if (strided) std::swap(stored[2], stored[3]);
        at::Tensor x = at::randn(stored, gen, at::kFloat) * 3;
        if (strided) x = x.transpose(2, 3);
        ASSERT_EQ(x.is_contiguous(), !strided);
        at::Tensor w = at::randn({h}, gen, at::kFloat) + 1;
        at::Tensor dy = at::randn(shape, gen, at::kFloat);
        at::Tensor x32 = x.clone().requires_grad_(!frozen_input);  // keeps x's strides
        ASSERT_EQ(x32.is_contiguous(), !strided);
        at::Tensor w32 = w.clone().requires_grad_(!frozen_weight);
        at::Tensor x64 = x.to(at::kDouble).requires_grad_(true);
        at::Tensor w64 = w.to(at::kDouble).requires_grad_(true);
        at::Tensor y32 = RmsNorm(x32, w32, 1e-6);
        at::Tensor y64 = RmsNorm(x64, w64, 1e-6);
        const std::string where = "shape " + c10::str(at::IntArrayRef(shape));
        EXPECT_LT((y32.to(at::kDouble) - y64).abs().max().item<double>(),
                  1e-6 * y64.abs().max().item<double>())
            << where;
        if (frozen_input && frozen_weight) continue;
        y32.backward(dy);
        y64.backward(dy.to(at::kDouble));
        if (!frozen_input) {
          EXPECT_LT((x32.grad().to(at::kDouble) - x64.grad()).abs().max().item<double>(),
                    1e-5 * x64.grad().abs().max().item<double>())
              << where;
        }
        if (!frozen_weight) {
          EXPECT_LT((w32.grad().to(at::kDouble) - w64.grad()).abs().max().item<double>(),
                    1e-5 * w64.grad().abs().max().item<double>())
              << where;
        }
      }
    }
  }
}

// The fused backward is not itself differentiable: asking for a graph of it
// is refused, not answered without RMSNorm's second-order terms.
TEST(RmsNorm, FusedBackwardRefusesCreateGraph) {
  at::Tensor x = at::randn({4, 16}).requires_grad_(true);
  at::Tensor w = at::ones({16}).requires_grad_(true);
  at::Tensor y = RmsNorm(x, w, 1e-6);
  EXPECT_THROW(torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true,
                                     /*create_graph=*/true),
               c10::Error);
  EXPECT_TRUE(torch::autograd::grad({y.sum()}, {x})[0].defined());
}

TEST(CountParameters, EqualsTheTensorsTheModelBuilds) {
  const std::vector<std::vector<std::string>> cases = {
      {},  // the demo, qwen3_moe
      {"model.model_type=deepseek_v3", "model.router_aux_loss_coef=0", "model.q_lora_rank=16",
       "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
       "model.v_head_dim=8", "model.n_group=2", "model.topk_group=1",
       "model.first_k_dense_replace=1", "model.n_shared_experts=2"},
      {"model.model_type=deepseek_v3", "model.router_aux_loss_coef=0", "model.q_lora_rank=0",
       "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
       "model.v_head_dim=8", "model.n_group=1", "model.topk_group=1",
       "model.first_k_dense_replace=0"},
      {"model.model_type=glm4_moe", "model.router_aux_loss_coef=0", "model.attention_bias=true",
       "model.use_qk_norm=true", "model.first_k_dense_replace=2"},
      {"model.model_type=qwen2_moe", "model.shared_expert_intermediate_size=48",
       "model.mlp_only_layers=[1]"},
  };
  for (const auto& sets : cases) {
    auto c = launch::LoadConfig("", sets);
    ASSERT_TRUE(c.ok()) << c.status();
    auto options = launch::ResolveModelConfig(c->model());
    ASSERT_TRUE(options.ok()) << options.status();
    auto model = MoeModel::Create(*options, {}, 0);
    ASSERT_TRUE(model.ok()) << model.status();
    int64_t total = 0, experts = 0;
    for (const Parameter& p : (*model)->parameters()) {
      total += p.tensor.numel();
      if (p.expert) experts += p.tensor.numel();
    }
    const ParameterCounts counts = CountParameters(*options);
    EXPECT_EQ(counts.total, total) << options->model_type;
    EXPECT_EQ(counts.routed_experts, experts) << options->model_type;
    EXPECT_EQ(counts.active, total - experts / options->num_experts *
                                         (options->num_experts - options->num_experts_per_tok))
        << options->model_type;
  }
}

}  // namespace
}  // namespace moefit::framework
