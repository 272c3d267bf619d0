// qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, no q/k/v
// bias by default, no shared expert, top-k weights renormalized when
// norm_topk_prob. Defaults are those of HF Qwen3MoeConfig.
#include "framework/families/qwen3_moe.h"

namespace moefit::framework {

ModelFamily Qwen3MoeFamily() {
  return {"qwen3_moe", "Qwen3MoeForCausalLM", [](ModelOptions& o) {
            o.qk_norm = true;
            o.attention_bias = false;
            o.rope_theta = 10000.0;
            o.rms_norm_eps = 1e-6;
            o.norm_topk_prob = false;
            o.router_aux_loss_coef = 0.001;
            o.decoder_sparse_step = 1;
            o.tie_word_embeddings = false;
            o.max_position_embeddings = 32768;
            o.initializer_range = 0.02;
          },
          /*from_hf_config=*/nullptr, &QwenMoeToHfConfig};
}

}  // namespace moefit::framework
