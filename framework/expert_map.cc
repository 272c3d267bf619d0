// The expert map; see expert_map.h.
#include "framework/expert_map.h"

#include <png.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moefit::framework {
namespace {

// ColorBrewer's RdBu, from cold (1/8 of the mean) to hot (8x), white in the middle.
constexpr std::array<std::array<double, 3>, 5> kStops = {
    {{33, 102, 172}, {146, 197, 222}, {247, 247, 247}, {244, 165, 130}, {178, 24, 43}}};
constexpr uint8_t kNoTokens[3] = {160, 160, 160};
constexpr double kLog2Range = 3;  // 1/8x .. 8x

}  // namespace

std::vector<uint8_t> ExpertMap::HotByShare() const {
  std::vector<uint8_t> hot(load.size(), 0);
  for (int64_t r = 0; r < num_rows(); ++r) {
    const float* row = load.data() + r * num_experts;
    double sum = 0;
    for (int64_t e = 0; e < num_experts; ++e) sum += row[e];
    const double mean = sum / static_cast<double>(num_experts);
    for (int64_t e = 0; e < num_experts; ++e) {
      hot[r * num_experts + e] = mean > 0 && row[e] >= 2 * mean;
    }
  }
  return hot;
}

CellSize ExpertMapCellSize(int64_t rows, int64_t experts) {
  return {
      .width = static_cast<int>(std::clamp<int64_t>(1200 / std::max<int64_t>(experts, 1), 4, 24)),
      .height = static_cast<int>(std::clamp<int64_t>(600 / std::max<int64_t>(rows, 1), 4, 24))};
}

void ExpertMapColour(double ratio, uint8_t rgb[3]) {
  if (ratio < 0) {
    std::memcpy(rgb, kNoTokens, 3);
    return;
  }
  // Position on the scale in [0, 4]: log2(ratio) from -3 to 3.
  const double t = ratio > 0 ? std::clamp(std::log2(ratio) / kLog2Range, -1.0, 1.0) : -1.0;
  const double x = (t + 1) * 2;
  const int i = std::min(3, static_cast<int>(x));
  const double f = x - i;
  for (int c = 0; c < 3; ++c) {
    rgb[c] = static_cast<uint8_t>(std::lround(kStops[i][c] * (1 - f) + kStops[i + 1][c] * f));
  }
}

absl::StatusOr<RgbImage> DrawExpertMap(const ExpertMap& map) {
  const int64_t rows = map.num_rows(), experts = map.num_experts;
  if (rows < 1 || experts < 1 || static_cast<int64_t>(map.load.size()) != rows * experts ||
      (!map.hot.empty() && map.hot.size() != map.load.size())) {
    return absl::InvalidArgumentError(absl::StrCat("expert map of ", rows, " layers x ", experts,
                                                   " experts with ", map.load.size(), " loads and ",
                                                   map.hot.size(), " hot flags"));
  }
  const std::vector<uint8_t> hot = map.hot.empty() ? map.HotByShare() : map.hot;
  const CellSize cell = ExpertMapCellSize(rows, experts);
  RgbImage image;
  image.width = static_cast<int>(experts) * cell.width;
  image.height = static_cast<int>(rows) * cell.height;
  image.pixels.assign(static_cast<size_t>(image.width) * image.height * 3, 0);
  const size_t stride = static_cast<size_t>(image.width) * 3;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = map.load.data() + r * experts;
    double sum = 0;
    for (int64_t e = 0; e < experts; ++e) sum += row[e];
    const double mean = sum / static_cast<double>(experts);
    // The row's first pixel line, cell by cell; the other lines copy it,
    // then the outlines of hot cells are drawn over.
    uint8_t* line = image.pixels.data() + static_cast<size_t>(r) * cell.height * stride;
    for (int64_t e = 0; e < experts; ++e) {
      uint8_t rgb[3];
      ExpertMapColour(mean > 0 ? row[e] / mean : -1.0, rgb);
      for (int x = 0; x < cell.width; ++x) std::memcpy(line + (e * cell.width + x) * 3, rgb, 3);
    }
    for (int y = 1; y < cell.height; ++y) std::memcpy(line + y * stride, line, stride);
    for (int64_t e = 0; e < experts; ++e) {
      if (!hot[r * experts + e]) continue;
      uint8_t* cell0 = line + e * cell.width * 3;
      for (int y = 0; y < cell.height; ++y) {
        uint8_t* p = cell0 + y * stride;
        if (y == 0 || y + 1 == cell.height) {
          std::memset(p, 0, static_cast<size_t>(cell.width) * 3);
        } else {
          std::memset(p, 0, 3);
          std::memset(p + (cell.width - 1) * 3, 0, 3);
        }
      }
    }
  }
  return image;
}

absl::StatusOr<std::string> EncodePng(const RgbImage& image) {
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  png.width = static_cast<png_uint_32>(image.width);
  png.height = static_cast<png_uint_32>(image.height);
  png.format = PNG_FORMAT_RGB;
  png.flags = PNG_IMAGE_FLAG_FAST;  // speed over size: fewer filters tried, fast zlib
  png_alloc_size_t size = 0;
  if (!png_image_write_get_memory_size(png, size, /*convert_to_8_bit=*/0, image.pixels.data(),
                                       /*row_stride=*/0, /*colormap=*/nullptr)) {
    return absl::InternalError(absl::StrCat("libpng: ", png.message));
  }
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&png, out.data(), &size, 0, image.pixels.data(), 0, nullptr)) {
    return absl::InternalError(absl::StrCat("libpng: ", png.message));
  }
  out.resize(size);
  return out;
}

absl::StatusOr<RgbImage> DecodePng(const std::string& bytes) {
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&png, bytes.data(), bytes.size())) {
    return absl::InvalidArgumentError(absl::StrCat("not a PNG: ", png.message));
  }
  png.format = PNG_FORMAT_RGB;
  RgbImage image;
  image.width = static_cast<int>(png.width);
  image.height = static_cast<int>(png.height);
  image.pixels.resize(PNG_IMAGE_SIZE(png));
  if (!png_image_finish_read(&png, /*background=*/nullptr, image.pixels.data(), 0, nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("libpng: ", png.message));
  }
  return image;
}

}  // namespace moefit::framework
