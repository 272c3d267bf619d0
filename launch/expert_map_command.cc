// The expert-map command; see expert_map_command.h.
#include "launch/expert_map_command.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "framework/expert_map.h"
#include "proto/metrics.pb.h"
#include "proto/status_macros.h"

namespace moefit::launch {
namespace {

namespace fs = std::filesystem;

// The step of a metrics line without parsing it whole: the trainer writes
// {"step":N,... first (lines run to hundreds of kB at hundreds of experts).
bool LineStep(const std::string& line, int64_t* step) {
  static const std::string kPrefix = "{\"step\":";
  if (line.compare(0, kPrefix.size(), kPrefix) != 0) return false;
  const size_t end = line.find_first_of(",}", kPrefix.size());
  return end != std::string::npos &&
         absl::SimpleAtoi(absl::string_view(line.data() + kPrefix.size(), end - kPrefix.size()),
                          step);
}

}  // namespace

absl::StatusOr<std::string> FindMetricsFile(const std::string& run_dir) {
  std::error_code ec;
  if (fs::is_regular_file(run_dir, ec)) return run_dir;
  if (!fs::is_directory(run_dir, ec)) {
    return absl::NotFoundError(absl::StrCat(run_dir, ": no such metrics file or run directory"));
  }
  const fs::path preferred = fs::path(run_dir) / "moefit-metrics.jsonl";
  if (fs::is_regular_file(preferred, ec)) return preferred.string();
  std::vector<std::string> found;
  for (const fs::directory_entry& e : fs::directory_iterator(run_dir, ec)) {
    if (e.is_regular_file() && e.path().extension() == ".jsonl") found.push_back(e.path().string());
  }
  if (found.size() == 1) return found[0];
  if (found.empty()) {
    return absl::NotFoundError(
        absl::StrCat(run_dir, ": no metrics file (*.jsonl, logging.metrics_file) in it"));
  }
  std::sort(found.begin(), found.end());
  return absl::InvalidArgumentError(
      absl::StrCat(run_dir, ": ", found.size(),
                   " *.jsonl files, name the metrics file: ", absl::StrJoin(found, ", ")));
}

absl::Status RunExpertMapCommand(const std::string& run_dir, const ExpertMapCommandOptions& options,
                                 std::ostream& log) {
  MOEFIT_ASSIGN_OR_RETURN(const std::string path, FindMetricsFile(run_dir));
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::string line, chosen;
  int64_t line_no = 0, chosen_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    int64_t step = 0;
    if (!LineStep(line, &step)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_no, ": not a metrics line (proto/metrics.proto)"));
    }
    if (options.step == 0 || step == options.step) {
      chosen = std::move(line);
      chosen_no = line_no;
    }
  }
  if (chosen.empty()) {
    return absl::NotFoundError(options.step == 0 ? absl::StrCat(path, ": no step in it")
                                                 : absl::StrCat(path, ": no step ", options.step));
  }
  proto::StepMetrics m;
  google::protobuf::util::JsonParseOptions parse;
  parse.ignore_unknown_fields = true;
  if (!google::protobuf::util::JsonStringToMessage(chosen, &m, parse).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ":", chosen_no, ": cannot parse"));
  }
  framework::ExpertMap map;
  for (const proto::LayerLoad& l : m.moe_layers()) {
    if (l.decayed_load_size() == 0 ||
        (map.num_experts != 0 && l.decayed_load_size() != map.num_experts)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", chosen_no, ": step ", m.step(), " has no decayed load for layer ", l.layer(),
          l.decayed_load_size() == 0 ? " (the run had logging.routing_telemetry off)" : ""));
    }
    map.num_experts = l.decayed_load_size();
    map.layer_idx.push_back(l.layer());
    map.load.insert(map.load.end(), l.decayed_load().begin(), l.decayed_load().end());
  }
  if (m.has_gpu_cache_share()) {
    // A run with the hot-expert cache: the experts the GPUs computed are outlined.
    map.hot.assign(map.load.size(), 0);
    for (int l = 0; l < m.moe_layers_size(); ++l) {
      for (int32_t x : m.moe_layers(l).gpu_experts()) {
        if (x >= 0 && x < map.num_experts) map.hot[l * map.num_experts + x] = 1;
      }
    }
  }
  if (map.layer_idx.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ":", chosen_no, ": step ", m.step(), " has no MoE layer"));
  }
  MOEFIT_ASSIGN_OR_RETURN(const framework::RgbImage image, framework::DrawExpertMap(map));
  MOEFIT_ASSIGN_OR_RETURN(const std::string png, framework::EncodePng(image));
  const std::string out = !options.out.empty()
                              ? options.out
                              : (fs::path(path).parent_path() / "expert-map.png").string();
  std::ofstream f(out, std::ios::binary | std::ios::trunc);
  f.write(png.data(), static_cast<std::streamsize>(png.size()));
  f.close();
  if (!f) return absl::InvalidArgumentError(absl::StrCat(out, ": cannot write"));
  log << "moefit: expert map of step " << m.step() << " (" << map.layer_idx.size()
      << " MoE layers x " << map.num_experts << " experts, " << image.width << " x " << image.height
      << " px) written to " << out << std::endl;
  return absl::OkStatus();
}

}  // namespace moefit::launch
