// The toy model the launch tests size by hand: small enough to redo every
// memory formula on paper.
#pragma once

#include "framework/model_options.h"

namespace moefit::launch::testing {

// H 64, experts of width 32, 10 experts top-2, 3 layers of which layer 1 is a
// dense MLP of width 96; GQA 4 heads x 16, 2 KV heads, q/k norms; vocab 300,
// untied LM head.
inline framework::ModelOptions ToyModel() {
  framework::ModelOptions o;
  o.model_type = "qwen3_moe";
  o.vocab_size = 300;
  o.hidden_size = 64;
  o.intermediate_size = 96;
  o.moe_intermediate_size = 32;
  o.num_hidden_layers = 3;
  o.num_attention_heads = 4;
  o.num_key_value_heads = 2;
  o.head_dim = 16;
  o.num_experts = 10;
  o.num_experts_per_tok = 2;
  o.mlp_only_layers = {1};
  o.qk_norm = true;
  return o;
}

}  // namespace moefit::launch::testing
