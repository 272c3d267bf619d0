// TensorBoard event files; see tensorboard_writer.h.
#include "framework/tensorboard_writer.h"

#include <unistd.h>

#include <algorithm>
#include <boost/crc.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moefit::framework {
namespace {

// Castagnoli's CRC-32: polynomial 0x1EDC6F41, init and final XOR all ones, reflected in and out.
using Crc32cComputer = boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true>;

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void PutLittleEndian(uint64_t v, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

uint32_t Crc32c(std::string_view data) {
  Crc32cComputer crc;
  crc.process_bytes(data.data(), data.size());
  return crc.checksum();
}

uint32_t MaskedCrc32c(std::string_view data) {
  const uint32_t crc = Crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string TfRecord(std::string_view payload) {
  std::string out;
  out.reserve(payload.size() + 16);
  PutLittleEndian(payload.size(), 8, &out);
  PutLittleEndian(MaskedCrc32c(out), 4, &out);
  out.append(payload);
  PutLittleEndian(MaskedCrc32c(payload), 4, &out);
  return out;
}

void AddScalar(tensorboard::Summary* summary, const std::string& tag, double value) {
  tensorboard::Summary::Value* v = summary->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
}

tensorboard::HistogramProto MakeHistogram(std::span<const double> values, int num_buckets) {
  tensorboard::HistogramProto h;
  if (values.empty()) return h;
  const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
  h.set_min(*lo);
  h.set_max(*hi);
  h.set_num(static_cast<double>(values.size()));
  double sum = 0, sum_squares = 0;
  for (double x : values) {
    sum += x;
    sum_squares += x * x;
  }
  h.set_sum(sum);
  h.set_sum_squares(sum_squares);
  const int n = *hi > *lo ? std::max(1, num_buckets) : 1;
  const double width = (*hi - *lo) / n;
  std::vector<double> counts(static_cast<size_t>(n), 0.0);
  for (double x : values) {
    // Bucket i holds (lo + i w, lo + (i + 1) w]; the minimum goes to bucket 0.
    int i = width > 0 ? static_cast<int>(std::ceil((x - *lo) / width)) - 1 : 0;
    counts[static_cast<size_t>(std::clamp(i, 0, n - 1))] += 1;
  }
  for (int i = 0; i < n; ++i) {
    h.add_bucket_limit(i + 1 == n ? *hi : *lo + (i + 1) * width);
    h.add_bucket(counts[static_cast<size_t>(i)]);
  }
  return h;
}

void AddHistogram(tensorboard::Summary* summary, const std::string& tag,
                  std::span<const double> values, int num_buckets) {
  tensorboard::Summary::Value* v = summary->add_value();
  v->set_tag(tag);
  *v->mutable_histo() = MakeHistogram(values, num_buckets);
}

void AddPngImage(tensorboard::Summary* summary, const std::string& tag, std::string png, int width,
                 int height) {
  tensorboard::Summary::Value* v = summary->add_value();
  v->set_tag(tag);
  tensorboard::Summary::Image* image = v->mutable_image();
  image->set_width(width);
  image->set_height(height);
  image->set_colorspace(3);
  image->set_encoded_image_string(std::move(png));
}

absl::StatusOr<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::Open(
    const std::filesystem::path& dir, int64_t first_step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat("logging.tensorboard_dir: cannot create '",
                                                   dir.string(), "': ", ec.message()));
  }
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  const std::filesystem::path path =
      dir / absl::StrCat("events.out.tfevents.", static_cast<int64_t>(Now()), ".", host, ".",
                         static_cast<int64_t>(::getpid()));
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("logging.tensorboard_dir: cannot write '",
                                                   path.string(), "': ", std::strerror(errno)));
  }
  std::unique_ptr<TensorBoardWriter> w(new TensorBoardWriter(path, f));
  tensorboard::Event version;
  version.set_wall_time(Now());
  version.set_file_version("brain.Event:2");
  absl::Status s = w->WriteEvent(version);
  if (s.ok() && first_step > 1) {
    tensorboard::Event start;
    start.set_wall_time(Now());
    start.set_step(first_step);
    start.mutable_session_log()->set_status(tensorboard::SessionLog::START);
    s = w->WriteEvent(start);
  }
  if (!s.ok()) return s;
  return w;
}

TensorBoardWriter::~TensorBoardWriter() { std::fclose(file_); }

absl::Status TensorBoardWriter::Write(int64_t step, const tensorboard::Summary& summary) {
  tensorboard::Event event;
  event.set_wall_time(Now());
  event.set_step(step);
  *event.mutable_summary() = summary;
  return WriteEvent(event);
}

absl::Status TensorBoardWriter::WriteEvent(const tensorboard::Event& event) {
  const std::string record = TfRecord(event.SerializeAsString());
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() ||
      std::fflush(file_) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot write '", path_.string(), "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace moefit::framework
