// `moefit inspect DIR|FILE`: what a checkpoint holds, without building a model.
//
// For a safetensors file or a model directory (config.json + *.safetensors,
// with or without model.safetensors.index.json): the tensors grouped by name
// pattern (layer and expert numbers folded into `*`, so a 48-layer, 128-expert
// model prints a screenful, not 18,000 lines), dtypes, shapes, bytes, total
// and active parameter counts, and the MoE layout read from the keys and
// config.json.
#pragma once

#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace moefit::launch {

absl::Status RunInspect(const std::string& path, std::ostream& out);

}  // namespace moefit::launch
