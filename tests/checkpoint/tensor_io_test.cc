// tensor_io: dtype mapping, zero-copy views that keep the mapping alive,
// conversions that match at::Tensor::to bit for bit, and writing tensors from
// any layout.
#include "checkpoint/tensor_io.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace moefit::checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class TensorIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           (std::string("moefit_tio_") +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Saves `tensors` and opens the file.
  SafetensorsFile SaveAndOpen(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
    const std::filesystem::path path = dir_ / "t.safetensors";
    const absl::Status saved = SaveTensors(path, tensors, {.sync = false});
    EXPECT_TRUE(saved.ok()) << saved;
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    EXPECT_TRUE(file.ok()) << file.status();
    return *std::move(file);
  }

  std::filesystem::path dir_;
};

// Bitwise equality (NaN payloads included) of two tensors of the same dtype.
void ExpectSameBits(const at::Tensor& actual, const at::Tensor& expected) {
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type());
  ASSERT_EQ(actual.sizes(), expected.sizes());
  const at::Tensor a = actual.contiguous();
  const at::Tensor e = expected.contiguous();
  ASSERT_EQ(a.nbytes(), e.nbytes());
  EXPECT_EQ(std::memcmp(a.const_data_ptr(), e.const_data_ptr(), a.nbytes()), 0);
}

// A tensor of `type` with varied values: every bit pattern for 1-byte types,
// otherwise scaled random normals (plus extremes) converted with Tensor::to.
at::Tensor Sample(at::ScalarType type) {
  if (c10::elementSize(type) == 1 && type != at::kBool) {
    return at::arange(256, at::kInt).to(at::kByte).view(type);
  }
  at::manual_seed(3);
  at::Tensor values = at::randn({4, 16}, at::kDouble) * 1000;
  values.view(-1)[0] = 0;
  values.view(-1)[1] = -1;
  values.view(-1)[2] = 65504;
  if (type == at::kBool) return values > 0;
  if (type == at::kUInt16 || type == at::kUInt32 || type == at::kUInt64)
    return values.abs().to(type);
  if (c10::isComplexType(type)) return at::complex(values, -values).to(type);
  return values.to(type);
}

TEST(TensorIoMappingTest, ScalarTypesRoundTrip) {
  for (Dtype dtype : AllDtypes()) {
    const std::optional<at::ScalarType> type = ToScalarType(dtype);
    if (dtype == Dtype::kF6E2M3 || dtype == Dtype::kF6E3M2) {
      EXPECT_FALSE(type.has_value());
      continue;
    }
    ASSERT_TRUE(type.has_value()) << DtypeName(dtype);
    EXPECT_EQ(ToDtype(*type).value(), dtype);
  }
  EXPECT_EQ(ToScalarType(Dtype::kF8E4M3), at::kFloat8_e4m3fn);
  EXPECT_EQ(ToScalarType(Dtype::kF8E5M2), at::kFloat8_e5m2);
  EXPECT_EQ(ToScalarType(Dtype::kBF16), at::kBFloat16);
  EXPECT_FALSE(ToDtype(at::kComplexDouble).ok());
  EXPECT_FALSE(ToDtype(at::kQInt8).ok());
}

TEST_F(TensorIoTest, StoredDtypeIsAViewThatOutlivesTheFile) {
  const at::Tensor expected = at::arange(12, at::kFloat).reshape({3, 4});
  at::Tensor view;
  const void* mapped = nullptr;
  {
    SafetensorsFile file = SaveAndOpen({{"w", expected}});
    absl::StatusOr<at::Tensor> read = ReadTensor(file, "w");
    ASSERT_TRUE(read.ok()) << read.status();
    view = *read;
    mapped = file.TensorBytes(file.tensors()[0]).data();
  }
  EXPECT_EQ(view.const_data_ptr(), mapped);  // no copy
  EXPECT_TRUE(at::equal(view, expected));    // and still readable: the deleter holds the mapping
}

TEST_F(TensorIoTest, CopyOptionGivesAWritableTensor) {
  SafetensorsFile file = SaveAndOpen({{"w", at::ones({5}, at::kInt)}});
  absl::StatusOr<at::Tensor> read = ReadTensor(file, "w", {.copy = true});
  ASSERT_TRUE(read.ok());
  EXPECT_NE(read->const_data_ptr(), file.TensorBytes(file.tensors()[0]).data());
  read->add_(1);
  EXPECT_TRUE(at::equal(*read, at::full({5}, 2, at::kInt)));
}

class ConversionTest : public TensorIoTest, public ::testing::WithParamInterface<at::ScalarType> {};

TEST_P(ConversionTest, ReadAsFloatAndDoubleMatchesTensorTo) {
  const at::Tensor stored = Sample(GetParam());
  SafetensorsFile file = SaveAndOpen({{"t", stored}});
  const at::Tensor same = ReadTensor(file, "t").value();
  ExpectSameBits(same, stored);
  const std::vector<at::ScalarType> targets =
      c10::isComplexType(GetParam())
          ? std::vector<at::ScalarType>{at::kComplexFloat, at::kComplexDouble}
          : std::vector<at::ScalarType>{at::kFloat, at::kDouble, at::kBFloat16};
  for (at::ScalarType target : targets) {
    absl::StatusOr<at::Tensor> read = ReadTensor(file, "t", {.dtype = target});
    ASSERT_TRUE(read.ok()) << read.status();
    ExpectSameBits(*read, stored.to(target));
  }
}

INSTANTIATE_TEST_SUITE_P(TorchDtypes, ConversionTest,
                         ::testing::Values(at::kBool, at::kByte, at::kChar, at::kShort, at::kInt,
                                           at::kLong, at::kHalf, at::kBFloat16, at::kFloat,
                                           at::kDouble, at::kFloat8_e4m3fn, at::kFloat8_e5m2,
                                           at::kFloat8_e4m3fnuz, at::kFloat8_e5m2fnuz,
                                           at::kFloat8_e8m0fnu, at::kUInt16, at::kUInt32,
                                           at::kUInt64, at::kComplexFloat),
                         [](const ::testing::TestParamInfo<at::ScalarType>& param) {
                           return std::string(c10::toString(param.param));
                         });

TEST_F(TensorIoTest, MisalignedTensorsAreCopiedCorrectly) {
  // A 3-byte BOOL first puts the F32 at data offset 3.
  const at::Tensor values = at::arange(6, at::kFloat) / 3;
  SafetensorsFile file = SaveAndOpen({{"mask", at::ones({3}, at::kBool)}, {"x", values}});
  EXPECT_EQ(file.Find("x")->begin, 3u);
  const at::Tensor read = ReadTensor(file, "x").value();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(read.const_data_ptr()) % 4, 0u);
  ExpectSameBits(read, values);
}

TEST_F(TensorIoTest, WritesNonContiguousAndLazyTensors) {
  const at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  const at::Tensor complex = at::complex(base, base + 1).conj();  // lazy conjugate bit
  SafetensorsFile file =
      SaveAndOpen({{"t", base.t()}, {"slice", base.select(1, 2)}, {"conj", complex}});
  ExpectSameBits(ReadTensor(file, "t").value(), base.t().contiguous());
  ExpectSameBits(ReadTensor(file, "slice").value(), base.select(1, 2).contiguous());
  ExpectSameBits(ReadTensor(file, "conj").value(), complex.resolve_conj());
  EXPECT_EQ(file.Find("t")->shape, (std::vector<int64_t>{4, 3}));
}

TEST_F(TensorIoTest, WritesAndReadsScalarsAndEmptyTensors) {
  SafetensorsFile file = SaveAndOpen(
      {{"s", at::scalar_tensor(2.5, at::kDouble)}, {"e", at::empty({0, 3}, at::kHalf)}});
  const at::Tensor s = ReadTensor(file, "s").value();
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.item<double>(), 2.5);
  const at::Tensor e = ReadTensor(file, "e", {.dtype = at::kFloat}).value();
  EXPECT_EQ(e.sizes(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(e.scalar_type(), at::kFloat);
}

TEST_F(TensorIoTest, F4IsHeldAsPackedFloat4) {
  const at::Tensor packed =
      at::arange(6, at::kInt).to(at::kByte).reshape({2, 3}).view(at::kFloat4_e2m1fn_x2);
  SafetensorsFile file = SaveAndOpen({{"q", packed}});
  EXPECT_EQ(file.Find("q")->dtype, Dtype::kF4);
  EXPECT_EQ(file.Find("q")->shape, (std::vector<int64_t>{2, 6}));  // F4 elements
  const at::Tensor read = ReadTensor(file, "q").value();
  ExpectSameBits(read, packed);
}

TEST_F(TensorIoTest, ErrorsNameFileAndTensor) {
  const std::filesystem::path path = dir_ / "f6.safetensors";
  SafetensorsWriter writer(path, {.sync = false});
  const std::vector<std::byte> three(3, std::byte{1});
  ASSERT_TRUE(writer.AddCopy("f6", Dtype::kF6E2M3, {4}, three).ok());
  const std::vector<std::byte> bad_bool = {std::byte{0}, std::byte{2}};
  ASSERT_TRUE(writer.AddCopy("mask", Dtype::kBool, {2}, bad_bool).ok());
  ASSERT_TRUE(writer.AddCopy("f4_1d", Dtype::kF4, {6}, three).ok());
  ASSERT_TRUE(writer.Finish().ok());
  SafetensorsFile file = SafetensorsFile::Open(path).value();

  auto message = [&](std::string_view name) {
    absl::StatusOr<at::Tensor> read = ReadTensor(file, name);
    EXPECT_FALSE(read.ok()) << name;
    return read.ok() ? std::string() : std::string(read.status().message());
  };
  EXPECT_THAT(message("f6"), AllOf(HasSubstr(path.string()), HasSubstr("\"f6\""),
                                   HasSubstr("F6_E2M3 has no torch equivalent")));
  EXPECT_THAT(message("mask"), AllOf(HasSubstr("\"mask\""), HasSubstr("element 1")));
  EXPECT_THAT(message("nope"), AllOf(HasSubstr(path.string()), HasSubstr("\"nope\"")));
  EXPECT_EQ(ReadTensor(file, "f4_1d").value().sizes(), (std::vector<int64_t>{3}));

  SafetensorsWriter bad(dir_ / "bad.safetensors", {.sync = false});
  EXPECT_THAT(std::string(AddTensor(bad, "u", at::Tensor()).message()), HasSubstr("\"u\""));
  EXPECT_THAT(std::string(AddTensor(bad, "cd", at::zeros({2}, at::kComplexDouble)).message()),
              AllOf(HasSubstr("\"cd\""), HasSubstr("no safetensors equivalent")));
}

TEST_F(TensorIoTest, OddLastDimensionF4CannotBeATorchTensor) {
  const std::filesystem::path path = dir_ / "f4.safetensors";
  SafetensorsWriter writer(path, {.sync = false});
  const std::vector<std::byte> three(3, std::byte{0x21});
  ASSERT_TRUE(writer.AddCopy("w", Dtype::kF4, {2, 3}, three).ok());
  ASSERT_TRUE(writer.Finish().ok());
  SafetensorsFile file = SafetensorsFile::Open(path).value();
  absl::StatusOr<at::Tensor> read = ReadTensor(file, "w");
  ASSERT_FALSE(read.ok());
  EXPECT_THAT(
      std::string(read.status().message()),
      AllOf(HasSubstr(path.string()), HasSubstr("\"w\""), HasSubstr("even last dimension")));
}

TEST_F(TensorIoTest, WritesFromCudaWhenAvailable) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const at::Tensor host = at::randn({64, 32}).to(at::kBFloat16);
  SafetensorsFile file = SaveAndOpen({{"w", host.to(at::kCUDA)}});
  ExpectSameBits(ReadTensor(file, "w").value(), host);
}

}  // namespace
}  // namespace moefit::checkpoint
