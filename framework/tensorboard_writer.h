// TensorBoard event files, written by moefit itself (no TensorFlow, no
// Python): what `tensorboard --logdir` and its EventAccumulator read.
//
// An event file is a sequence of TFRecords, each
//     uint64 length (little-endian) | uint32 masked CRC-32C of those 8 bytes
//     | length bytes of payload     | uint32 masked CRC-32C of the payload
// where the payload is one serialized tensorboard.Event
// (proto/tensorboard_event.proto) and a masked CRC is
// ((crc >> 15) | (crc << 17)) + 0xa282ead8 (TFRecord's guard against CRCs of
// data that holds CRCs). The CRC-32C (Castagnoli polynomial 0x1EDC6F41,
// reflected, initial and final XOR 0xFFFFFFFF) is Boost.CRC's
// crc_optimal, from Debian's header-only libboost-dev: Debian 12 has no
// libcrc32c package and its Abseil (20220623) no CRC-32C, and a checksum is
// not something to write by hand.
//
// The first event of a file is its version ("brain.Event:2"); a run that
// starts at step s > 1 (resumed from a training checkpoint) then writes a
// SessionLog START at step s, which tells readers to drop the events at
// steps >= s that an interrupted run left in older files of the directory.
// Each training step is one Event whose Summary holds all of the step's
// values: scalars (float), histograms and PNG images.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "proto/tensorboard_event.pb.h"

namespace moefit::framework {

// CRC-32C of `data`, and TFRecord's masked form of it.
uint32_t Crc32c(std::string_view data);
uint32_t MaskedCrc32c(std::string_view data);

// One TFRecord holding `payload`.
std::string TfRecord(std::string_view payload);

// Appends a scalar, a histogram of `values` (num_buckets equal-width buckets
// between their min and max) or an image (a PNG file's bytes; colorspace 3:
// RGB) to `summary`.
void AddScalar(tensorboard::Summary* summary, const std::string& tag, double value);
void AddHistogram(tensorboard::Summary* summary, const std::string& tag,
                  std::span<const double> values, int num_buckets = 30);
void AddPngImage(tensorboard::Summary* summary, const std::string& tag, std::string png, int width,
                 int height);

// The histogram AddHistogram writes: count, sum, sum of squares, min and max
// of `values`, and bucket i holding the values in (limit[i-1], limit[i]] with
// limit[i] = min + (i + 1) (max - min) / num_buckets (one bucket when all
// values are equal; none when there are no values).
tensorboard::HistogramProto MakeHistogram(std::span<const double> values, int num_buckets);

class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents) and a new event file in it,
  // events.out.tfevents.<seconds>.<host>.<pid>, starting with the file
  // version and, when first_step > 1, a SessionLog START at first_step.
  // InvalidArgument naming `dir` when it cannot be created or written.
  static absl::StatusOr<std::unique_ptr<TensorBoardWriter>> Open(const std::filesystem::path& dir,
                                                                 int64_t first_step);
  ~TensorBoardWriter();

  // Writes `summary` as the Event of `step`, stamped now, and flushes it to
  // the file (a live TensorBoard sees it at once).
  absl::Status Write(int64_t step, const tensorboard::Summary& summary);

  const std::filesystem::path& path() const { return path_; }

 private:
  TensorBoardWriter(std::filesystem::path path, std::FILE* file)
      : path_(std::move(path)), file_(file) {}
  absl::Status WriteEvent(const tensorboard::Event& event);

  std::filesystem::path path_;
  std::FILE* file_;
};

}  // namespace moefit::framework
