// The expert map: a picture of which experts the routers use, one row per
// MoE layer (the first at the top) and one column per expert (expert 0 at
// the left), each cell coloured by the expert's decayed load (its decayed
// access counter, router/routing_stats.h) relative to the mean of its layer,
// on a log scale: white is a fair share, red up to 8x (and beyond), blue
// down to 1/8x (and below); grey marks a layer that has seen no token. The
// hot experts are outlined in black: those holding at least twice the mean
// of their layer (ExpertMap::HotByShare), or the set a caller names (the
// experts a GPU cache holds).
//
// Drawn into an RGB raster, then encoded by libpng (Debian's libpng-dev,
// through its simplified write API, tuned for speed): the trainer writes one
// every logging.expert_map_every_steps and at the end, and `moefit
// expert-map` draws it again from the metrics file. The loads are taken as
// the metrics file stores them (float32), so both draw the same pixels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moefit::framework {

struct ExpertMap {
  std::vector<int64_t> layer_idx;  // decoder layer of each row
  int64_t num_experts = 0;
  // Row-major [rows, num_experts].
  std::vector<float> load;
  // Row-major [rows, num_experts]: outlined cells; empty = HotByShare().
  std::vector<uint8_t> hot;

  int64_t num_rows() const { return static_cast<int64_t>(layer_idx.size()); }
  // The cells whose load is at least twice their row's mean.
  std::vector<uint8_t> HotByShare() const;
};

// An 8-bit RGB raster, row-major, 3 bytes per pixel.
struct RgbImage {
  int width = 0, height = 0;
  std::vector<uint8_t> pixels;
};

// Pixel size of each cell for a map of rows x experts: wide enough to show
// (4 px at least), the whole about 1200 x 600 px for large models.
struct CellSize {
  int width = 0, height = 0;
};
CellSize ExpertMapCellSize(int64_t rows, int64_t experts);

// The colour of a load `ratio` times its layer's mean (negative: the layer
// saw no token).
void ExpertMapColour(double ratio, uint8_t rgb[3]);

// Draws the map; InvalidArgument when its sizes do not agree.
absl::StatusOr<RgbImage> DrawExpertMap(const ExpertMap& map);

// The PNG file of `image` (libpng); Internal when libpng refuses it.
absl::StatusOr<std::string> EncodePng(const RgbImage& image);
// Reads a PNG file's bytes back into RGB (libpng), for tests and checks.
absl::StatusOr<RgbImage> DecodePng(const std::string& png);

}  // namespace moefit::framework
