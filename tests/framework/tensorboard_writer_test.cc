// TensorBoard event files at the byte level: the CRC-32C against the
// published check values (RFC 3720's iSCSI vectors and the "123456789" check
// value of the CRC catalogue), the TFRecord framing read back field by field,
// and a whole file parsed back into the Events written. (The file against
// TensorBoard's own reader: tests/interop/test_tensorboard.py.)
#include "framework/tensorboard_writer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace moefit::framework {
namespace {

uint64_t ReadLe(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

TEST(Crc32c, PublishedCheckValues) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  // RFC 3720, B.4: 32 bytes of zeros, of ones, ascending, descending.
  std::string zeros(32, '\0'), ones(32, '\xff'), up(32, '\0'), down(32, '\0');
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<char>(i);
    down[i] = static_cast<char>(31 - i);
  }
  EXPECT_EQ(Crc32c(zeros), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(up), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(down), 0x113FDB5Cu);
  // An iSCSI read command PDU (RFC 3720, B.4).
  const unsigned char pdu[48] = {0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00,
                                 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00,
                                 0x00, 0x18, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
  EXPECT_EQ(Crc32c(std::string(reinterpret_cast<const char*>(pdu), sizeof(pdu))), 0xD9963A56u);
}

TEST(Crc32c, MaskIsTfRecords) {
  const uint32_t crc = Crc32c("moefit");
  EXPECT_EQ(MaskedCrc32c("moefit"), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

TEST(TfRecord, FramesThePayload) {
  const std::string payload = "an event, serialized";
  const std::string r = TfRecord(payload);
  ASSERT_EQ(r.size(), payload.size() + 16);
  EXPECT_EQ(ReadLe(r, 0, 8), payload.size());
  EXPECT_EQ(ReadLe(r, 8, 4), MaskedCrc32c(r.substr(0, 8)));
  EXPECT_EQ(r.substr(12, payload.size()), payload);
  EXPECT_EQ(ReadLe(r, 12 + payload.size(), 4), MaskedCrc32c(payload));
}

TEST(Histogram, BucketsCountEveryValueOnce) {
  const std::vector<double> v = {0, 1, 1, 2, 3, 5, 8, 13, 21, 34};
  tensorboard::HistogramProto h = MakeHistogram(v, 4);
  EXPECT_EQ(h.min(), 0);
  EXPECT_EQ(h.max(), 34);
  EXPECT_EQ(h.num(), 10);
  EXPECT_EQ(h.sum(), 88);
  EXPECT_EQ(h.sum_squares(), 0 + 1 + 1 + 4 + 9 + 25 + 64 + 169 + 441 + 1156);
  ASSERT_EQ(h.bucket_limit_size(), 4);
  // (-inf, 8.5], (8.5, 17], (17, 25.5], (25.5, 34]
  EXPECT_EQ(h.bucket_limit(0), 8.5);
  EXPECT_EQ(h.bucket_limit(3), 34);
  const std::vector<double> want = {7, 1, 1, 1};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(h.bucket(i), want[i]) << i;
  // Equal values: one bucket; none: an empty histogram.
  tensorboard::HistogramProto same = MakeHistogram(std::vector<double>{2, 2, 2}, 30);
  ASSERT_EQ(same.bucket_size(), 1);
  EXPECT_EQ(same.bucket(0), 3);
  EXPECT_EQ(same.bucket_limit(0), 2);
  EXPECT_EQ(MakeHistogram({}, 30).num(), 0);
}

TEST(TensorBoardWriter, FileParsesBackIntoTheEvents) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "tb_writer";
  std::filesystem::remove_all(dir);
  std::filesystem::path path;
  {
    auto w = TensorBoardWriter::Open(dir / "run", /*first_step=*/7);
    ASSERT_TRUE(w.ok()) << w.status();
    path = (*w)->path();
    EXPECT_NE(path.filename().string().find("events.out.tfevents."), std::string::npos);
    tensorboard::Summary s;
    AddScalar(&s, "train/loss", 2.5);
    AddHistogram(&s, "load", std::vector<double>{1, 2, 3});
    AddPngImage(&s, "map", "\x89PNG not really", 4, 3);
    ASSERT_TRUE((*w)->Write(7, s).ok());
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  std::vector<tensorboard::Event> events;
  for (size_t at = 0; at < bytes.size();) {
    ASSERT_LE(at + 12, bytes.size());
    const uint64_t n = ReadLe(bytes, at, 8);
    ASSERT_EQ(ReadLe(bytes, at + 8, 4), MaskedCrc32c(bytes.substr(at, 8)));
    ASSERT_LE(at + 16 + n, bytes.size());
    const std::string payload = bytes.substr(at + 12, n);
    ASSERT_EQ(ReadLe(bytes, at + 12 + n, 4), MaskedCrc32c(payload));
    events.emplace_back();
    ASSERT_TRUE(events.back().ParseFromString(payload));
    at += 16 + n;
  }
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  EXPECT_GT(events[0].wall_time(), 1.6e9);
  EXPECT_EQ(events[1].session_log().status(), tensorboard::SessionLog::START);
  EXPECT_EQ(events[1].step(), 7);
  const tensorboard::Summary& s = events[2].summary();
  EXPECT_EQ(events[2].step(), 7);
  ASSERT_EQ(s.value_size(), 3);
  EXPECT_EQ(s.value(0).tag(), "train/loss");
  EXPECT_EQ(s.value(0).simple_value(), 2.5f);
  EXPECT_EQ(s.value(1).histo().num(), 3);
  EXPECT_EQ(s.value(2).image().width(), 4);
  EXPECT_EQ(s.value(2).image().encoded_image_string(), "\x89PNG not really");

  // A fresh run (first step 1) writes no START.
  auto fresh = TensorBoardWriter::Open(dir / "fresh", 1);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(std::filesystem::file_size((*fresh)->path()),
            TfRecord(events[0].SerializeAsString()).size());
}

TEST(TensorBoardWriter, UnwritableDirectoryIsNamed) {
  auto w = TensorBoardWriter::Open("/proc/moefit-no-such-dir/tb", 1);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("logging.tensorboard_dir: cannot create '/proc/"),
            std::string::npos)
      << w.status();
}

}  // namespace
}  // namespace moefit::framework
