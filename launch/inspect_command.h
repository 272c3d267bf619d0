// `moefit inspect DIR|FILE`: what a checkpoint holds, without building a model.
//
// For a safetensors file or a model directory (config.json + *.safetensors,
// with or without model.safetensors.index.json): the tensors grouped by name
// pattern (layer and expert numbers folded into `*`, so a 48-layer, 128-expert
// model prints a screenful, not 18,000 lines), dtypes, shapes, bytes, total
// and active parameter counts, the MoE layout read from the keys and
// config.json, and config.json's quantization format (e.g. "compressed-tensors
// pack-quantized int4, group 32, symmetric").
//
// The parameter counts are what transformers' model.parameters() gives for the
// model: FP8 weights count by element and compressed-tensors' packed int4
// weights (`X.weight_packed`) by their logical shape (`X.weight_shape`: 8
// values per stored int32); their scales (`*_scale_inv`, `*.weight_scale`),
// zero points and shapes, and the buffers stored with the weights (the
// router's e_score_correction_bias, old checkpoints' rotary inv_freq) do not
// count, nor do the multi-token-prediction
// layers stored after the decoder layers (index >= num_hidden_layers when
// config.json has num_nextn_predict_layers > 0), which get a line of their own.
// Active per token: everything but the routed experts, plus top-k / E of them;
// shared experts are always active.
#pragma once

#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace moefit::launch {

absl::Status RunInspect(const std::string& path, std::ostream& out);

}  // namespace moefit::launch
