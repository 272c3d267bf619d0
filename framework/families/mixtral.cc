// mixtral (Mixtral-8x7B, 8x22B): every layer sparse, top-k weights always
// renormalized, no biases, no q/k norm, no shared expert. Its config.json names
// the expert count num_local_experts and the expert width intermediate_size;
// launch/ maps those onto num_experts and moe_intermediate_size.
// Defaults are those of HF MixtralConfig.
#include "framework/families/mixtral.h"

namespace moefit::framework {

ModelFamily MixtralFamily() {
  return {"mixtral", "MixtralForCausalLM", [](ModelOptions& o) {
            o.qk_norm = false;
            o.attention_bias = false;
            o.rope_theta = 1e6;
            o.rms_norm_eps = 1e-5;
            o.norm_topk_prob = true;
            o.router_aux_loss_coef = 0.001;
            o.decoder_sparse_step = 1;
            o.tie_word_embeddings = false;
            o.max_position_embeddings = 4096 * 32;
            o.initializer_range = 0.02;
          }};
}

}  // namespace moefit::framework
