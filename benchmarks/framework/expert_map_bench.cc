// The expert map's cost per image: drawing the raster and encoding the PNG
// (framework/expert_map.h) of a DeepSeek-V3-sized map, 58 MoE layers of 256
// experts, and a Kimi-K2-sized one, 60 x 384 (61 layers, the first dense),
// or --rows= --experts=; loads drawn from an exponential distribution (a few
// hot experts per layer, as trained routers have). Prints the median of
// --reps=20 images, after one untimed, in milliseconds, and the PNG's size.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "framework/expert_map.h"

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t rows = 0, experts = 0, reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--rows=", 0) == 0)
      rows = std::atoll(a.c_str() + 7);
    else if (a.rfind("--experts=", 0) == 0)
      experts = std::atoll(a.c_str() + 10);
    else if (a.rfind("--reps=", 0) == 0)
      reps = std::max<int64_t>(1, std::atoll(a.c_str() + 7));
    else {
      std::fprintf(stderr, "usage: expert_map_bench [--rows=R --experts=E] [--reps=N]\n");
      return 2;
    }
  }
  std::vector<std::pair<int64_t, int64_t>> shapes = {{58, 256}, {60, 384}, {61, 384}};
  if (rows > 0 && experts > 0) shapes = {{rows, experts}};
  for (auto [r, e] : shapes) {
    moefit::framework::ExpertMap map;
    map.num_experts = e;
    for (int64_t l = 0; l < r; ++l) map.layer_idx.push_back(l);
    std::mt19937 gen(1);
    std::exponential_distribution<float> load(1.0f / 1000);
    for (int64_t i = 0; i < r * e; ++i) map.load.push_back(load(gen));
    std::vector<double> draw_ms, encode_ms;
    size_t bytes = 0;
    int width = 0, height = 0;
    for (int64_t rep = 0; rep <= reps; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      auto image = moefit::framework::DrawExpertMap(map);
      const auto t1 = std::chrono::steady_clock::now();
      auto png = moefit::framework::EncodePng(*image);
      const auto t2 = std::chrono::steady_clock::now();
      if (!png.ok()) {
        std::fprintf(stderr, "%s\n", png.status().ToString().c_str());
        return 1;
      }
      if (rep == 0) continue;
      draw_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      encode_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      bytes = png->size();
      width = image->width;
      height = image->height;
    }
    const double d = Median(draw_ms), c = Median(encode_ms);
    std::printf(
        "%3lld layers x %3lld experts (%d x %d px): draw %.2f ms + PNG %.2f ms = %.2f ms "
        "per image, %zu bytes\n",
        static_cast<long long>(r), static_cast<long long>(e), width, height, d, c, d + c, bytes);
  }
  return 0;
}
