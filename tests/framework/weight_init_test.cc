// How MoeModel::Create fills the weights: a rank's experts drawn row by row
// (RandnRows) are exactly its rows of the full seeded draw, with the generator
// left where the full draw leaves it, so random initialization is unchanged
// and N ranks still start from the weights of one; and an uninitialized model
// has the random model's tensors, by name, shape, dtype and device.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cstring>
#include <utility>
#include <vector>

#include "framework/model.h"
#include "launch/config.h"

namespace moefit::framework {
namespace {

bool SameBytes(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         std::memcmp(a.contiguous().const_data_ptr(), b.contiguous().const_data_ptr(),
                     a.nbytes()) == 0;
}

TEST(RandnRows, EqualsTheFullDrawNarrowed) {
  // Rows of 128, 35 (not a multiple of 16: the full draw), 768, 16, 8 and
  // 1040 elements.
  const std::vector<std::vector<int64_t>> shapes = {{4, 8, 16}, {3, 5, 7}, {6, 32, 24},
                                                    {5, 1, 16}, {7, 2, 4}, {3, 10, 104}};
  for (const auto& shape : shapes) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const int64_t rows = shape[0];
      for (const auto& [first, num] : std::vector<std::pair<int64_t, int64_t>>{
               {0, rows}, {1, rows - 2}, {rows - 1, 1}, {rows / 2, 0}}) {
        SCOPED_TRACE(testing::Message() << c10::IntArrayRef(shape) << " " << dtype << " rows ["
                                        << first << ", " << first + num << ")");
        at::Generator full_gen = at::make_generator<at::CPUGeneratorImpl>(42);
        const at::Tensor full = at::randn(shape, full_gen, at::kFloat) * 0.02;
        const at::Tensor full_next = at::randn({40}, full_gen, at::kFloat);
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(42);
        const at::Tensor rows_drawn = RandnRows(shape, first, num, 0.02, dtype, gen);
        EXPECT_TRUE(SameBytes(rows_drawn, full.narrow(0, first, num).to(dtype)));
        EXPECT_TRUE(SameBytes(at::randn({40}, gen, at::kFloat), full_next));
      }
    }
  }
}

TEST(WeightInit, UninitializedHasTheTensorsOfRandom) {
  auto config = launch::LoadConfig("", {"model.num_experts=6", "model.use_qk_norm=true"});
  ASSERT_TRUE(config.ok()) << config.status();
  auto run = launch::ResolveConfig(*config);
  ASSERT_TRUE(run.ok()) << run.status();
  run->runtime.expert_dtype = at::kBFloat16;
  auto random = MoeModel::Create(run->model, run->runtime, 3);
  auto empty = MoeModel::Create(run->model, run->runtime, 3, WeightInit::kUninitialized);
  ASSERT_TRUE(random.ok() && empty.ok());
  const std::vector<Parameter> a = (*random)->named_tensors();
  const std::vector<Parameter> b = (*empty)->named_tensors();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].tensor.sizes(), b[i].tensor.sizes()) << a[i].name;
    EXPECT_EQ(a[i].tensor.scalar_type(), b[i].tensor.scalar_type()) << a[i].name;
    EXPECT_EQ(a[i].tensor.device(), b[i].tensor.device()) << a[i].name;
    EXPECT_EQ(a[i].tensor.requires_grad(), b[i].tensor.requires_grad()) << a[i].name;
    EXPECT_EQ(a[i].expert, b[i].expert) << a[i].name;
    EXPECT_TRUE(b[i].tensor.is_contiguous()) << a[i].name;
  }
}

}  // namespace
}  // namespace moefit::framework
