// The expert map: every pixel of the raster against its definition computed
// pixel by pixel (which cell, its colour from the load over the row's mean,
// whether it lies on a hot cell's border), the colour scale's fixed points,
// the hot rule, the PNG read back by libpng into the same pixels, and sizes
// that do not agree refused.
#include "framework/expert_map.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace moefit::framework {
namespace {

ExpertMap RandomMap(int64_t rows, int64_t experts, uint32_t seed) {
  ExpertMap m;
  m.num_experts = experts;
  for (int64_t r = 0; r < rows; ++r) m.layer_idx.push_back(r + 1);
  std::mt19937 gen(seed);
  std::exponential_distribution<float> load(0.01f);
  for (int64_t i = 0; i < rows * experts; ++i) m.load.push_back(load(gen));
  // A row that saw no token, and a row with one expert far above the rest.
  for (int64_t e = 0; e < experts; ++e) m.load[e] = 0;
  if (rows > 1) m.load[experts + 1] = 1e6f;
  return m;
}

// The colour of pixel (x, y) by the definition.
void ExpectedPixel(const ExpertMap& m, const std::vector<uint8_t>& hot, int x, int y,
                   uint8_t rgb[3]) {
  const CellSize cell = ExpertMapCellSize(m.num_rows(), m.num_experts);
  const int64_t e = x / cell.width, r = y / cell.height;
  const int cx = x % cell.width, cy = y % cell.height;
  if (hot[r * m.num_experts + e] &&
      (cx == 0 || cy == 0 || cx == cell.width - 1 || cy == cell.height - 1)) {
    rgb[0] = rgb[1] = rgb[2] = 0;
    return;
  }
  double sum = 0;
  for (int64_t j = 0; j < m.num_experts; ++j) sum += m.load[r * m.num_experts + j];
  const double mean = sum / m.num_experts;
  ExpertMapColour(mean > 0 ? m.load[r * m.num_experts + e] / mean : -1.0, rgb);
}

void ExpectPixelsByDefinition(const ExpertMap& m, const RgbImage& image) {
  const std::vector<uint8_t> hot = m.hot.empty() ? m.HotByShare() : m.hot;
  const CellSize cell = ExpertMapCellSize(m.num_rows(), m.num_experts);
  ASSERT_EQ(image.width, m.num_experts * cell.width);
  ASSERT_EQ(image.height, m.num_rows() * cell.height);
  int64_t wrong = 0;
  for (int y = 0; y < image.height; ++y) {
    for (int x = 0; x < image.width; ++x) {
      uint8_t want[3];
      ExpectedPixel(m, hot, x, y, want);
      const uint8_t* got = image.pixels.data() + (static_cast<size_t>(y) * image.width + x) * 3;
      wrong += got[0] != want[0] || got[1] != want[1] || got[2] != want[2];
    }
  }
  EXPECT_EQ(wrong, 0);
}

TEST(ExpertMap, EveryPixelIsItsDefinition) {
  for (auto [rows, experts] : {std::pair<int64_t, int64_t>{4, 8}, {3, 64}, {61, 384}, {1, 1}}) {
    const ExpertMap m = RandomMap(rows, experts, static_cast<uint32_t>(rows * experts));
    auto image = DrawExpertMap(m);
    ASSERT_TRUE(image.ok()) << image.status();
    ExpectPixelsByDefinition(m, *image);
  }
}

TEST(ExpertMap, NamedHotSetIsOutlined) {
  ExpertMap m = RandomMap(3, 16, 9);
  m.hot.assign(m.load.size(), 0);
  m.hot[5] = m.hot[16 + 15] = m.hot[32] = 1;
  auto image = DrawExpertMap(m);
  ASSERT_TRUE(image.ok());
  ExpectPixelsByDefinition(m, *image);
}

TEST(ExpertMap, ColourScaleAndHotRule) {
  uint8_t rgb[3];
  ExpertMapColour(1.0, rgb);  // a fair share: near white
  EXPECT_EQ(rgb[0], 247);
  EXPECT_EQ(rgb[1], 247);
  EXPECT_EQ(rgb[2], 247);
  ExpertMapColour(8.0, rgb);  // 8x and beyond: the reddest
  EXPECT_EQ(rgb[0], 178);
  uint8_t beyond[3];
  ExpertMapColour(1000.0, beyond);
  EXPECT_EQ(std::vector<uint8_t>(rgb, rgb + 3), std::vector<uint8_t>(beyond, beyond + 3));
  ExpertMapColour(0.0, rgb);  // never chosen: the bluest
  EXPECT_EQ(rgb[2], 172);
  ExpertMapColour(-1.0, rgb);  // a layer without tokens: grey
  EXPECT_EQ(rgb[0], rgb[2]);

  ExpertMap m;
  m.num_experts = 4;
  m.layer_idx = {0, 1};
  m.load = {1, 1, 1, 5, 0, 0, 0, 0};  // mean 2: only 5 is >= 2x
  EXPECT_EQ(m.HotByShare(), (std::vector<uint8_t>{0, 0, 0, 1, 0, 0, 0, 0}));
}

TEST(ExpertMap, PngReadsBackAsTheRaster) {
  const ExpertMap m = RandomMap(61, 384, 1);
  auto image = DrawExpertMap(m);
  ASSERT_TRUE(image.ok());
  auto png = EncodePng(*image);
  ASSERT_TRUE(png.ok()) << png.status();
  EXPECT_EQ(png->substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  auto back = DecodePng(*png);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->width, image->width);
  EXPECT_EQ(back->height, image->height);
  EXPECT_TRUE(back->pixels == image->pixels);
  EXPECT_FALSE(DecodePng("not a png").ok());
}

TEST(ExpertMap, SizesThatDisagreeAreRefused) {
  ExpertMap m = RandomMap(2, 8, 3);
  m.load.pop_back();
  EXPECT_FALSE(DrawExpertMap(m).ok());
  ExpertMap none;
  EXPECT_FALSE(DrawExpertMap(none).ok());
  ExpertMap bad_hot = RandomMap(2, 8, 3);
  bad_hot.hot = {1};
  EXPECT_FALSE(DrawExpertMap(bad_hot).ok());
}

}  // namespace
}  // namespace moefit::framework
