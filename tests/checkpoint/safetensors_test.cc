// Tests of the torch-free safetensors layer: write -> read round trips for every
// dtype, file and natural order, the writer's contract, and one test per kind of
// corrupt file, each checking that the error names the file and the tensor.
//
// Corrupt files are assembled byte by byte (safetensors_test_util.h) because the
// writer refuses to produce them. This binary is also built with ASan+UBSan
// (safetensors_test_asan), so every case doubles as an out-of-bounds check.
#include "checkpoint/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/checkpoint/safetensors_test_util.h"

namespace moefit::checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;
using testing::SafetensorsBytes;
using testing::SafetensorsBytesWithLength;
using testing::WriteBytes;

std::span<const std::byte> AsBytes(std::string_view s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

std::string ReadAll(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::path(::testing::TempDir()) /
           (std::string("moefit_st_") + info->test_suite_name() + "_" + info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes `bytes` as `name` and opens it; the open must fail. Returns the error.
  absl::Status OpenCorrupt(std::string_view name, const std::string& bytes) {
    path_ = WriteBytes(dir_, name, bytes);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path_);
    EXPECT_FALSE(file.ok()) << "opened a corrupt file: " << name;
    // The same bytes from memory must fail the same way.
    absl::StatusOr<SafetensorsHeader> header = ParseHeader(AsBytes(bytes), path_.string());
    EXPECT_FALSE(header.ok());
    if (!header.ok() && !file.ok()) {
      EXPECT_EQ(header.status(), file.status());
    }
    return file.ok() ? absl::OkStatus() : file.status();
  }

  std::filesystem::path dir_;
  std::filesystem::path path_;  // of the last corrupt file
};

// Expects a failed status whose message mentions every one of `parts`.
void ExpectErrorNames(const absl::Status& status, std::initializer_list<std::string_view> parts) {
  EXPECT_FALSE(status.ok());
  for (std::string_view part : parts) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(std::string(part)));
  }
}
// The macro adds the caller's line to failures, and evaluates `status` before
// the parts (which may name the file that evaluating it just wrote).
#define EXPECT_ERROR_NAMES(status, ...)               \
  do {                                                \
    SCOPED_TRACE("EXPECT_ERROR_NAMES");               \
    const absl::Status status_to_check = (status);    \
    ExpectErrorNames(status_to_check, {__VA_ARGS__}); \
  } while (0)

// ---------------------------------------------------------------------------
// Dtype table

TEST(DtypeTest, NamesRoundTripAndSizes) {
  EXPECT_EQ(AllDtypes().size(), 22u);
  for (Dtype dtype : AllDtypes()) {
    EXPECT_EQ(DtypeFromName(DtypeName(dtype)), dtype) << DtypeName(dtype);
  }
  EXPECT_EQ(DtypeFromName("F8_E4M3FN"), std::nullopt);
  EXPECT_EQ(DtypeFromName("f32"), std::nullopt);
  EXPECT_EQ(DtypeBits(Dtype::kBool), 8);
  EXPECT_EQ(DtypeBits(Dtype::kBF16), 16);
  EXPECT_EQ(DtypeBits(Dtype::kC64), 64);
  EXPECT_EQ(DtypeBits(Dtype::kF8E8M0), 8);
  EXPECT_EQ(DtypeBits(Dtype::kF6E3M2), 6);
  EXPECT_EQ(DtypeBits(Dtype::kF4), 4);
  EXPECT_EQ(DtypeByteSize(Dtype::kF4, 6), 3u);
  EXPECT_EQ(DtypeByteSize(Dtype::kF4, 5), std::nullopt);
  EXPECT_EQ(DtypeByteSize(Dtype::kF6E2M3, 4), 3u);
  EXPECT_EQ(DtypeByteSize(Dtype::kF6E2M3, 2), std::nullopt);
  EXPECT_EQ(DtypeByteSize(Dtype::kF64, uint64_t{1} << 61), std::nullopt);  // overflow
}

// ---------------------------------------------------------------------------
// Round trips

class DtypeRoundTripTest : public SafetensorsTest, public ::testing::WithParamInterface<Dtype> {};

TEST_P(DtypeRoundTripTest, WriteThenRead) {
  const Dtype dtype = GetParam();
  // 24 elements fill whole bytes for every element size (4, 6, 8, ... bits).
  const std::vector<int64_t> shape = {2, 3, 4};
  const std::string bytes = testing::PseudoRandomBytes(*DtypeByteSize(dtype, 24), 7);
  const std::filesystem::path path = dir_ / "one.safetensors";
  SafetensorsWriter writer(path,
                           {.metadata = {{"dtype", std::string(DtypeName(dtype))}}, .sync = false});
  ASSERT_TRUE(writer.Add("t", dtype, shape, AsBytes(bytes)).ok());
  // A scalar, for the dtypes where one element fills whole bytes.
  const std::optional<uint64_t> scalar_bytes = DtypeByteSize(dtype, 1);
  if (scalar_bytes) {
    ASSERT_TRUE(writer.AddCopy("scalar", dtype, {}, AsBytes(bytes).first(*scalar_bytes)).ok());
  }
  ASSERT_TRUE(writer.Finish().ok());

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const TensorInfo* info = file->Find("t");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->dtype, dtype);
  EXPECT_EQ(info->shape, shape);
  EXPECT_EQ(info->numel, 24);
  const std::span<const std::byte> read = file->TensorBytes(*info);
  ASSERT_EQ(read.size(), bytes.size());
  EXPECT_EQ(std::memcmp(read.data(), bytes.data(), bytes.size()), 0);
  EXPECT_THAT(file->metadata(),
              ElementsAre(Pair("dtype", std::string(DtypeName(dtype))), Pair("format", "pt")));
  if (scalar_bytes) {
    const TensorInfo* scalar = file->Find("scalar");
    ASSERT_NE(scalar, nullptr);
    EXPECT_TRUE(scalar->shape.empty());
    EXPECT_EQ(scalar->numel, 1);
    EXPECT_EQ(scalar->num_bytes(), *scalar_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, DtypeRoundTripTest,
                         ::testing::ValuesIn(AllDtypes().begin(), AllDtypes().end()),
                         [](const ::testing::TestParamInfo<Dtype>& param) {
                           return std::string(DtypeName(param.param));
                         });

TEST_F(SafetensorsTest, ManyTensorsKeepOrderLayoutAndPadding) {
  const std::filesystem::path path = dir_ / "many.safetensors";
  SafetensorsWriter writer(path, {.metadata = {{"step", "12"}}, .sync = false});
  std::vector<std::string> payloads;
  // The writer keeps spans, not copies: the strings must not move until Finish.
  payloads.reserve(6);
  std::vector<std::string> names = {"z.bias", "experts.10.w", "experts.9.w", "a", "empty", "s"};
  const std::vector<std::vector<int64_t>> shapes = {{3}, {2, 2}, {2, 2}, {5}, {0, 7}, {}};
  const std::vector<Dtype> dtypes = {Dtype::kBool, Dtype::kF32, Dtype::kF32,
                                     Dtype::kI8,   Dtype::kF64, Dtype::kBF16};
  for (size_t idx = 0; idx < names.size(); ++idx) {
    uint64_t numel = 1;
    for (int64_t dim : shapes[idx]) numel *= static_cast<uint64_t>(dim);
    payloads.push_back(testing::PseudoRandomBytes(*DtypeByteSize(dtypes[idx], numel), idx));
    ASSERT_TRUE(writer.Add(names[idx], dtypes[idx], shapes[idx], AsBytes(payloads[idx])).ok());
  }
  EXPECT_EQ(writer.num_tensors(), names.size());
  ASSERT_TRUE(writer.Finish().ok());
  EXPECT_FALSE(std::filesystem::exists(dir_ / "many.safetensors.tmp"));

  const std::string raw = ReadAll(path);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<uint8_t>(raw[i]);
  EXPECT_EQ(header_size % 8, 0u);
  EXPECT_EQ(raw.substr(8, 15), R"({"__metadata__")");
  EXPECT_EQ(raw.size(), 8 + header_size + writer.data_size());

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->TensorNames(), names);  // file order = order added
  EXPECT_THAT(file->SortedTensorNames(),
              ElementsAre("a", "empty", "experts.9.w", "experts.10.w", "s", "z.bias"));
  uint64_t offset = 0;
  for (size_t idx = 0; idx < names.size(); ++idx) {
    const TensorInfo& info = file->tensors()[idx];
    EXPECT_EQ(info.begin, offset) << info.name;  // contiguous, in the order given
    offset = info.end;
    absl::StatusOr<std::span<const std::byte>> bytes = file->TensorBytes(names[idx]);
    ASSERT_TRUE(bytes.ok());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(bytes->data()), bytes->size()),
              payloads[idx]);
  }
  EXPECT_EQ(offset, file->data_size());
  EXPECT_TRUE(file->tensors()[5].shape.empty());
  EXPECT_EQ(file->tensors()[5].numel, 1);
  EXPECT_EQ(file->tensors()[4].numel, 0);
}

TEST_F(SafetensorsTest, EmptyFileHasOnlyMetadata) {
  const std::filesystem::path path = dir_ / "empty.safetensors";
  SafetensorsWriter writer(path, {.sync = true});
  ASSERT_TRUE(writer.Finish().ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->num_tensors(), 0u);
  EXPECT_THAT(file->metadata(), ElementsAre(Pair("format", "pt")));
}

TEST_F(SafetensorsTest, FinishReplacesAnExistingFileAtomically) {
  const std::filesystem::path path = WriteBytes(dir_, "x.safetensors", "old contents");
  SafetensorsWriter writer(path, {.sync = false});
  ASSERT_TRUE(writer.AddCopy("t", Dtype::kU8, {2}, AsBytes("ab")).ok());
  ASSERT_TRUE(writer.Finish().ok());
  EXPECT_TRUE(SafetensorsFile::Open(path).ok());
  EXPECT_EQ(writer.Finish().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SafetensorsTest, FailedWriteLeavesNothing) {
  const std::filesystem::path path = dir_ / "no_such_dir" / "x.safetensors";
  SafetensorsWriter writer(path, {.sync = false});
  ASSERT_TRUE(writer.AddCopy("t", Dtype::kU8, {1}, AsBytes("a")).ok());
  EXPECT_ERROR_NAMES(writer.Finish(), path.string());
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST_F(SafetensorsTest, WriterRejectsBadTensors) {
  const std::filesystem::path path = dir_ / "w.safetensors";
  SafetensorsWriter writer(path, {.sync = false});
  ASSERT_TRUE(writer.AddCopy("a", Dtype::kF32, {1}, AsBytes("abcd")).ok());
  EXPECT_ERROR_NAMES(writer.AddCopy("a", Dtype::kF32, {1}, AsBytes("abcd")), path.string(), "\"a\"",
                     "twice");
  EXPECT_ERROR_NAMES(writer.AddCopy("b", Dtype::kF32, {2}, AsBytes("abcd")), "\"b\"", "needs 8");
  EXPECT_ERROR_NAMES(writer.AddCopy("c", Dtype::kF32, {-1}, AsBytes("")), "\"c\"", "negative");
  EXPECT_ERROR_NAMES(writer.AddCopy("d", Dtype::kF4, {3}, AsBytes("ab")), "\"d\"", "whole");
  EXPECT_ERROR_NAMES(writer.AddCopy("__metadata__", Dtype::kU8, {0}, AsBytes("")), "reserved");
  EXPECT_ERROR_NAMES(writer.AddCopy("", Dtype::kU8, {0}, AsBytes("")), "empty");
  EXPECT_EQ(writer.num_tensors(), 1u);
}

TEST_F(SafetensorsTest, NonUtf8NameFailsAtFinishAndWritesNothing) {
  const std::filesystem::path path = dir_ / "utf8.safetensors";
  SafetensorsWriter writer(path, {.sync = false});
  ASSERT_TRUE(writer.AddCopy("bad\xff", Dtype::kU8, {1}, AsBytes("a")).ok());
  EXPECT_ERROR_NAMES(writer.Finish(), path.string(), "UTF-8");
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST_F(SafetensorsTest, CallerMetadataCanReplaceFormat) {
  const std::filesystem::path path = dir_ / "m.safetensors";
  SafetensorsWriter writer(path, {.metadata = {{"format", "mlx"}, {"a", "b"}}, .sync = false});
  ASSERT_TRUE(writer.Finish().ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  EXPECT_THAT(file->metadata(), ElementsAre(Pair("a", "b"), Pair("format", "mlx")));
}

TEST_F(SafetensorsTest, BufferKeepsOwnerAliveThroughKeepAlive) {
  auto bytes = std::make_shared<std::string>(
      SafetensorsBytes(R"({"t":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})", "xyz"));
  std::weak_ptr<std::string> weak = bytes;
  std::shared_ptr<const void> keep;
  {
    absl::StatusOr<SafetensorsFile> file =
        SafetensorsFile::FromBuffer(AsBytes(*bytes), "buffer", bytes);
    bytes.reset();
    ASSERT_TRUE(file.ok()) << file.status();
    keep = file->keep_alive();
  }
  EXPECT_FALSE(weak.expired());
  keep.reset();
  EXPECT_TRUE(weak.expired());
}

TEST_F(SafetensorsTest, MissingTensorAndMissingFile) {
  const std::filesystem::path path = dir_ / "w.safetensors";
  SafetensorsWriter writer(path, {.sync = false});
  ASSERT_TRUE(writer.Finish().ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->Find("nope"), nullptr);
  EXPECT_EQ(file->Info("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_ERROR_NAMES(file->TensorBytes("nope").status(), path.string(), "\"nope\"");

  const std::filesystem::path missing = dir_ / "missing.safetensors";
  absl::StatusOr<SafetensorsFile> none = SafetensorsFile::Open(missing);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_ERROR_NAMES(none.status(), missing.string());
  EXPECT_ERROR_NAMES(SafetensorsFile::Open(dir_).status(), dir_.string(), "regular file");
}

// ---------------------------------------------------------------------------
// Corrupt files: one test per check. kF32At0 is a valid entry for data bytes [0, 4).

constexpr absl::string_view kF32At0 = R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";

TEST_F(SafetensorsTest, RejectsEmptyFile) {
  EXPECT_ERROR_NAMES(OpenCorrupt("empty.safetensors", ""), path_.string(), "too short");
}

TEST_F(SafetensorsTest, RejectsFileShorterThanLength) {
  EXPECT_ERROR_NAMES(OpenCorrupt("short.safetensors", std::string("\x02\x00\x00\x00", 4)),
                     path_.string(), "4 bytes", "too short");
}

TEST_F(SafetensorsTest, RejectsHeaderLengthBeyondFile) {
  EXPECT_ERROR_NAMES(OpenCorrupt("long.safetensors", SafetensorsBytesWithLength(64, "{}", "")),
                     path_.string(), "header length 64", "past the end");
}

TEST_F(SafetensorsTest, RejectsHeaderOver100MB) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt("huge.safetensors", SafetensorsBytesWithLength(100'000'001, "{}", "")),
      path_.string(), "100000001", "limit");
  EXPECT_ERROR_NAMES(
      OpenCorrupt("max.safetensors", SafetensorsBytesWithLength(~uint64_t{0}, "{}", "")),
      path_.string(), "limit");
}

TEST_F(SafetensorsTest, RejectsMalformedJson) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt("json.safetensors", SafetensorsBytes(absl::StrCat("{", kF32At0, ","), "abcd")),
      path_.string(), "malformed JSON");
  EXPECT_ERROR_NAMES(OpenCorrupt("nul.safetensors",
                                 SafetensorsBytesWithLength(3, std::string_view("{}\0", 3), "")),
                     path_.string(), "malformed JSON", "NUL byte at offset 2");
  EXPECT_ERROR_NAMES(OpenCorrupt("utf8.safetensors", SafetensorsBytes("{\"\xff\":{}}", "")),
                     path_.string(), "malformed JSON");
}

TEST_F(SafetensorsTest, RejectsHeaderThatIsNotAnObject) {
  EXPECT_ERROR_NAMES(OpenCorrupt("array.safetensors", SafetensorsBytes("[1, 2]", "")),
                     path_.string(), "not a JSON object");
  EXPECT_ERROR_NAMES(OpenCorrupt("zero.safetensors", SafetensorsBytes("", "", false)),
                     path_.string(), "not a JSON object");
}

TEST_F(SafetensorsTest, RejectsEntryThatIsNotAnObject) {
  EXPECT_ERROR_NAMES(OpenCorrupt("entry.safetensors", SafetensorsBytes(R"({"w.0":[1,2]})", "")),
                     path_.string(), "\"w.0\"", "not a JSON object");
}

TEST_F(SafetensorsTest, RejectsMetadataThatIsNotStrings) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt("meta.safetensors", SafetensorsBytes(R"({"__metadata__":{"step":7}})", "")),
      path_.string(), "\"step\"", "not a string");
  EXPECT_ERROR_NAMES(
      OpenCorrupt("meta2.safetensors", SafetensorsBytes(R"({"__metadata__":[]})", "")),
      path_.string(), "__metadata__");
}

TEST_F(SafetensorsTest, RejectsMissingFields) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt("nodtype.safetensors",
                  SafetensorsBytes(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", "x")),
      path_.string(), "\"w\"", "dtype");
  EXPECT_ERROR_NAMES(
      OpenCorrupt("noshape.safetensors",
                  SafetensorsBytes(R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", "x")),
      path_.string(), "\"w\"", "shape");
  EXPECT_ERROR_NAMES(OpenCorrupt("nooffsets.safetensors",
                                 SafetensorsBytes(R"({"w":{"dtype":"U8","shape":[1]}})", "x")),
                     path_.string(), "\"w\"", "data_offsets");
}

TEST_F(SafetensorsTest, RejectsUnknownDtype) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "dtype.safetensors",
          SafetensorsBytes(R"({"w":{"dtype":"F8_E4M3FN","shape":[1],"data_offsets":[0,1]}})", "x")),
      path_.string(), "\"w\"", "unknown dtype \"F8_E4M3FN\"");
}

TEST_F(SafetensorsTest, RejectsNegativeShape) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "neg.safetensors",
          SafetensorsBytes(R"({"w":{"dtype":"U8","shape":[2,-1],"data_offsets":[0,0]}})", "")),
      path_.string(), "\"w\"", "shape[1] = -1");
}

TEST_F(SafetensorsTest, RejectsNonIntegerShape) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "float.safetensors",
          SafetensorsBytes(R"({"w":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}})", "xx")),
      path_.string(), "\"w\"", "shape[0]", "not a non-negative integer");
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "string.safetensors",
          SafetensorsBytes(R"({"w":{"dtype":"U8","shape":["2"],"data_offsets":[0,2]}})", "xx")),
      path_.string(), "\"w\"", "shape[0]");
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "big.safetensors",
          SafetensorsBytes(
              R"({"w":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,2]}})", "xx")),
      path_.string(), "\"w\"", "shape[0]");
}

TEST_F(SafetensorsTest, RejectsNumelOverflow) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt("overflow.safetensors",
                  SafetensorsBytes(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296,0],)"
                                   R"("data_offsets":[0,0]}})",
                                   "")),
      path_.string(), "\"w\"", "2^63-1");
  // numel fits int64 but numel x 8 bytes does not fit 64 bits.
  EXPECT_ERROR_NAMES(
      OpenCorrupt("bytes.safetensors",
                  SafetensorsBytes(R"({"w":{"dtype":"F64","shape":[4611686018427387904],)"
                                   R"("data_offsets":[0,0]}})",
                                   "")),
      path_.string(), "\"w\"", "overflows 64 bits");
}

TEST_F(SafetensorsTest, RejectsOffsetsThatAreNotAPair) {
  for (std::string_view offsets : {"[0]", "[0,1,2]", "[0,\"1\"]", "[-1,1]", "[0,1.5]", "7"}) {
    EXPECT_ERROR_NAMES(
        OpenCorrupt(
            "pair.safetensors",
            SafetensorsBytes(absl::StrCat(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":)",
                                          absl::string_view(offsets.data(), offsets.size()), "}}"),
                             "x")),
        path_.string(), "\"w\"", "[begin, end]");
  }
}

TEST_F(SafetensorsTest, RejectsEndBeforeBegin) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "order.safetensors",
          SafetensorsBytes(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}})", "x")),
      path_.string(), "\"w\"", "end before");
}

TEST_F(SafetensorsTest, RejectsOffsetsOutOfRange) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "range.safetensors",
          SafetensorsBytes(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "xx")),
      path_.string(), "\"w\"", "past the data section (2 bytes)");
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "huge.safetensors",
          SafetensorsBytes(R"({"w":{"dtype":"U8","shape":[1],)"
                           R"("data_offsets":[18446744073709551614,18446744073709551615]}})",
                           "x")),
      path_.string(), "\"w\"", "past the data section");
}

TEST_F(SafetensorsTest, RejectsByteSizeMismatch) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "size.safetensors",
          SafetensorsBytes(R"({"w":{"dtype":"F16","shape":[3],"data_offsets":[0,4]}})", "xxxx")),
      path_.string(), "\"w\"", "hold 4 bytes", "needs 6");
}

TEST_F(SafetensorsTest, RejectsSubByteTensorThatDoesNotFillBytes) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "f4.safetensors",
          SafetensorsBytes(R"({"w":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", "xx")),
      path_.string(), "\"w\"", "whole number of bytes");
}

TEST_F(SafetensorsTest, RejectsOverlappingTensors) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt("overlap.safetensors",
                  SafetensorsBytes(absl::StrCat("{", kF32At0, R"(,"b":{"dtype":"F32","shape":[1],)",
                                                R"("data_offsets":[2,6]}})"),
                                   "xxxxxx")),
      path_.string(), "\"b\"", "overlap tensor \"a\"");
  // The same range twice is an overlap too.
  EXPECT_ERROR_NAMES(
      OpenCorrupt("alias.safetensors",
                  SafetensorsBytes(absl::StrCat("{", kF32At0, R"(,"b":{"dtype":"F32","shape":[1],)",
                                                R"("data_offsets":[0,4]}})"),
                                   "xxxx")),
      path_.string(), "overlap");
}

TEST_F(SafetensorsTest, RejectsHoleInDataSection) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt("hole.safetensors",
                  SafetensorsBytes(absl::StrCat("{", kF32At0, R"(,"b":{"dtype":"F32","shape":[1],)",
                                                R"("data_offsets":[6,10]}})"),
                                   "xxxxxxxxxx")),
      path_.string(), "\"b\"", "[4, 6)", "no holes");
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "lead.safetensors",
          SafetensorsBytes(R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "xx")),
      path_.string(), "\"b\"", "[0, 1)");
}

TEST_F(SafetensorsTest, RejectsBytesAfterTheLastTensor) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt("tail.safetensors", SafetensorsBytes(absl::StrCat("{", kF32At0, "}"), "xxxxyy")),
      path_.string(), "6 bytes", "cover only 4", "\"a\"");
  EXPECT_ERROR_NAMES(OpenCorrupt("notensor.safetensors", SafetensorsBytes("{}", "junk")),
                     path_.string(), "4 bytes", "cover only 0");
}

TEST_F(SafetensorsTest, RejectsDuplicateTensorNames) {
  EXPECT_ERROR_NAMES(
      OpenCorrupt(
          "dup.safetensors",
          SafetensorsBytes(absl::StrCat("{", kF32At0, ",",
                                        R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})"),
                           "xxxxxxxx")),
      path_.string(), "duplicate key \"a\"");
}

TEST_F(SafetensorsTest, RejectsDuplicateFieldsInAnEntry) {
  EXPECT_ERROR_NAMES(OpenCorrupt("dupfield.safetensors",
                                 SafetensorsBytes(R"({"w":{"dtype":"U8","dtype":"I8","shape":[1],)"
                                                  R"("data_offsets":[0,1]}})",
                                                  "x")),
                     path_.string(), "duplicate key \"dtype\" in \"w\"");
}

TEST_F(SafetensorsTest, RejectsDeepNesting) {
  const std::string deep =
      absl::StrCat(R"({"w":)", std::string(1000, '['), std::string(1000, ']'), "}");
  EXPECT_ERROR_NAMES(OpenCorrupt("deep.safetensors", SafetensorsBytes(deep, "")), path_.string(),
                     "nested deeper");
}

TEST_F(SafetensorsTest, AcceptsZeroSizedTensorsAnywhere) {
  // Zero-byte ranges may sit at any offset inside the data section, even
  // between or at the edge of other tensors, as the reference allows.
  const std::string bytes =
      SafetensorsBytes(absl::StrCat("{", kF32At0,
                                    R"(,"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                                    R"("f":{"dtype":"F32","shape":[2,0],"data_offsets":[0,0]}})"),
                       "xxxx");
  absl::StatusOr<SafetensorsHeader> header = ParseHeader(AsBytes(bytes), "mem");
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->tensors.size(), 3u);
}

}  // namespace
}  // namespace moefit::checkpoint
