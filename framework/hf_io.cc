// Pretrained weights in, HF directories out; see hf_io.h.
#include "framework/hf_io.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "checkpoint/weight_exporter.h"
#include "framework/families/family.h"
#include "framework/output_dir.h"
#include "proto/status_macros.h"

namespace moefit::framework {
namespace {

namespace fs = std::filesystem;

// All ranks' strings, in rank order.
std::vector<std::string> AllGatherStrings(parallel::Communicator& comm, const std::string& mine) {
  at::Tensor len = at::empty({comm.size()}, at::kLong);
  comm.AllGather(at::full({1}, static_cast<int64_t>(mine.size()), at::kLong), len)->WaitOrThrow();
  std::vector<int64_t> lens(len.data_ptr<int64_t>(), len.data_ptr<int64_t>() + comm.size());
  at::Tensor send = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  std::memcpy(send.data_ptr(), mine.data(), mine.size());
  at::Tensor recv = at::empty({len.sum().item<int64_t>()}, at::kByte);
  comm.AllGatherV(send, recv, lens)->WaitOrThrow();
  std::vector<std::string> out;
  const char* p = static_cast<const char*>(recv.data_ptr());
  for (int64_t n : lens) {
    out.emplace_back(p, static_cast<size_t>(n));
    p += n;
  }
  return out;
}

}  // namespace

void SetCheckpointFormat(const ModelOptions& o, checkpoint::LoadOptions& load) {
  if (o.fp8_weight_block) load.fp8_block = *o.fp8_weight_block;
  load.fp8_scale_suffix = o.fp8_scale_suffix;
  load.int4 = o.int4_weights;
  // They follow the decoder layers: DeepSeek-V3's model.layers.61, GLM-4.5's
  // model.layers.92.
  if (o.num_nextn_predict_layers > 0) {
    load.skip_layers_from = o.num_hidden_layers;
    load.skip_layers_until = o.num_hidden_layers + o.num_nextn_predict_layers;
  }
}

std::string DtypeName(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    case at::kFloat8_e4m3fn:
      return "float8_e4m3fn";
    case at::kByte:
      return "int4";
    default:
      return "float32";
  }
}

absl::StatusOr<at::ScalarType> CheckpointBaseDtype(const std::string& dir) {
  // Packed int4 weights are not among the weights counted: an int4
  // checkpoint's base is its dense weights' dtype.
  MOEFIT_ASSIGN_OR_RETURN(const at::ScalarType stored, checkpoint::StoredWeightDtype(dir));
  if (stored == at::kBFloat16 || stored == at::kFloat8_e4m3fn) return at::kBFloat16;
  return at::kFloat;
}

absl::Status LoadPretrained(MoeModel& model, const std::string& dir,
                            checkpoint::LoadReport* report) {
  const int ep_rank = model.runtime().expert_group->rank();
  checkpoint::LoadOptions options;
  options.first_expert = model.placement().first_expert(ep_rank);
  options.num_experts = model.placement().num_local(ep_rank);
  options.num_threads = model.runtime().expert_threads;
  SetCheckpointFormat(model.options(), options);
  const std::vector<Parameter> tensors_wanted = model.named_tensors();
  for (const Parameter& p : tensors_wanted) {
    options.expected[p.name] = {p.tensor.sizes().vec(), p.tensor.scalar_type()};
    // The loader writes host tensors where they are: no second copy of the
    // weights to build and copy over.
    if (p.tensor.device().is_cpu() && p.tensor.is_contiguous()) {
      options.destinations[p.name] = p.tensor;
    }
  }
  MOEFIT_ASSIGN_OR_RETURN(
      auto tensors, checkpoint::LoadCheckpoint(dir, model.options().model_type, options, report));
  torch::NoGradGuard no_grad;
  for (const Parameter& p : tensors_wanted) {
    if (options.destinations.contains(p.name)) continue;
    auto it = tensors.find(p.name);
    if (it == tensors.end()) {
      return absl::NotFoundError(absl::StrCat(dir, ": no tensor for ", p.name));
    }
    p.tensor.copy_(it->second);
    tensors.erase(it);  // each host copy goes once it is on the device
  }
  model.SyncExpertCopies();
  return absl::OkStatus();
}

std::string HfConfigJson(const ModelOptions& o, at::ScalarType dtype,
                         const std::string& base_config_json) {
  nlohmann::json j = nlohmann::json::object();
  if (!base_config_json.empty()) {
    std::ifstream in(base_config_json);
    nlohmann::json base = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (base.is_object()) j = base;
  }
  // Loaded as written: the weights are dequantized, and the rotary settings
  // are restated below in the current form.
  for (const char* stale : {"quantization_config", "rope_scaling", "rope_parameters", "rope_theta",
                            "partial_rotary_factor", "torch_dtype", "dtype"}) {
    j.erase(stale);
  }
  const ModelFamily* family = FindModelFamily(o.model_type);
  j["architectures"] = {family != nullptr ? family->architecture : o.model_type};
  j["model_type"] = o.hf_model_type.empty() ? o.model_type : o.hf_model_type;
  j["vocab_size"] = o.vocab_size;
  j["hidden_size"] = o.hidden_size;
  j["num_hidden_layers"] = o.num_hidden_layers;
  j["num_attention_heads"] = o.num_attention_heads;
  j["num_key_value_heads"] = o.num_key_value_heads;
  j["head_dim"] = o.head_dim;
  j["num_experts_per_tok"] = o.num_experts_per_tok;
  j["router_aux_loss_coef"] = o.router_aux_loss_coef;
  j["rms_norm_eps"] = o.rms_norm_eps;
  j["rope_theta"] = o.rope_theta;
  nlohmann::json rope = {{"rope_theta", o.rope_theta}, {"rope_type", o.rope_scaling.type}};
  if (o.rope_scaling.type == "yarn") {
    const RopeScaling& r = o.rope_scaling;
    rope["factor"] = r.factor;
    rope["original_max_position_embeddings"] = r.original_max_position_embeddings;
    rope["beta_fast"] = r.beta_fast;
    rope["beta_slow"] = r.beta_slow;
    if (r.mscale != 0) rope["mscale"] = r.mscale;
    if (r.mscale_all_dim != 0) rope["mscale_all_dim"] = r.mscale_all_dim;
    if (r.attention_factor) rope["attention_factor"] = *r.attention_factor;
    if (!r.truncate) rope["truncate"] = false;
  }
  if (o.attention == AttentionKind::kGqa && o.partial_rotary_factor != 1.0) {
    rope["partial_rotary_factor"] = o.partial_rotary_factor;
  }
  j["rope_parameters"] = rope;
  // A model_type transformers does not know (kimi_k2) is loaded by the
  // directory's own code, which reads the older rope_scaling key.
  if (!o.hf_model_type.empty() && o.rope_scaling.type == "yarn") {
    nlohmann::json legacy = rope;
    legacy.erase("rope_theta");
    legacy.erase("rope_type");
    legacy["type"] = "yarn";
    j["rope_scaling"] = legacy;
  }
  j["tie_word_embeddings"] = o.tie_word_embeddings;
  j["max_position_embeddings"] = o.max_position_embeddings;
  j["initializer_range"] = o.initializer_range;
  j["hidden_act"] = "silu";
  j["torch_dtype"] = DtypeName(dtype);
  if (family != nullptr && family->to_hf_config != nullptr) family->to_hf_config(o, j);
  return j.dump(2) + "\n";
}

absl::Status SaveHfDirectory(const MoeModel& model, const std::string& dir,
                             const parallel::ProcessGroups& groups, const SaveOptions& options) {
  if (model.runtime().quantized_experts()) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir,
        ": the model's experts are FP8 or int4; a Hugging Face directory is written from "
        "bfloat16 or float32 experts (experts.dtype)"));
  }
  HfTensors in;
  in.family = model.options().model_type;
  for (const Parameter& p : model.named_tensors()) {
    in.tensors[p.name] = p.tensor.detach().to(at::kCPU);
  }
  in.first_expert = model.placement().first_expert(model.runtime().expert_group->rank());
  in.num_global_experts = model.options().num_experts;
  // The first expert-parallel group writes (replicas hold the same experts).
  in.writes = groups.ep_group_idx == 0;
  in.config_json_text =
      HfConfigJson(model.options(), options.dtype.value_or(at::kFloat), options.base_config_json);
  in.copy_files_from = options.copy_files_from;
  return SaveHfTensors(in, dir, *groups.world, options);
}

absl::Status SaveHfTensors(const HfTensors& in, const std::string& dir_in,
                           parallel::Communicator& world, const SaveOptions& options) {
  const bool rank0 = world.rank() == 0;
  const fs::path dir = fs::path(dir_in).lexically_normal();
  fs::path partial = fs::path(dir.string() + ".partial");
  std::error_code ec;
  absl::Status staged = rank0 ? StageDirectory(dir, &partial) : absl::OkStatus();
  if (AnyRankFailed(world, !staged.ok())) {
    return staged.ok() ? absl::InternalError("rank 0 could not create the directory") : staged;
  }

  checkpoint::ExportOptions eo;
  eo.first_expert = in.first_expert;
  eo.write_dense = rank0;
  eo.num_global_experts = in.num_global_experts;
  eo.max_shard_bytes = options.max_shard_bytes;
  eo.dtype = options.dtype;
  absl::StatusOr<checkpoint::ExportPlan> plan =
      in.writes ? checkpoint::PlanExport(in.family, in.tensors, eo)
                : absl::StatusOr<checkpoint::ExportPlan>(checkpoint::ExportPlan{});
  if (AnyRankFailed(world, !plan.ok())) {
    return plan.ok() ? absl::InternalError("another rank could not plan its shards")
                     : plan.status();
  }

  // Global shard numbering: ranks' shards in rank order.
  at::Tensor counts = at::empty({world.size()}, at::kLong);
  world.AllGather(at::full({1}, static_cast<int64_t>(plan->num_shards()), at::kLong), counts)
      ->WaitOrThrow();
  const int first = static_cast<int>(counts.narrow(0, 0, world.rank()).sum().item<int64_t>());
  const int total = static_cast<int>(counts.sum().item<int64_t>());
  absl::StatusOr<std::map<std::string, std::string>> fragment =
      std::map<std::string, std::string>();
  if (plan->num_shards() > 0)
    fragment = checkpoint::WriteExportShards(partial, *plan, first, total);
  if (AnyRankFailed(world, !fragment.ok())) {
    return fragment.ok() ? absl::InternalError("another rank could not write its shards")
                         : fragment.status();
  }

  nlohmann::json mine = {{"total", plan->total_bytes}, {"map", *fragment}};
  std::vector<std::string> all = AllGatherStrings(world, mine.dump());
  absl::Status status = absl::OkStatus();
  if (rank0) {
    std::map<std::string, std::string> weight_map;
    uint64_t total_bytes = 0;
    for (const std::string& s : all) {
      nlohmann::json j = nlohmann::json::parse(s);
      total_bytes += j["total"].get<uint64_t>();
      for (auto& [k, v] : j["map"].items()) weight_map[k] = v.get<std::string>();
    }
    // One shard is model.safetensors on its own, as transformers writes it.
    if (total > 1) status = checkpoint::WriteIndex(partial, weight_map, total_bytes);
    if (status.ok()) status = WriteTextFile(partial / "config.json", in.config_json_text);
    if (status.ok() && !in.copy_files_from.empty()) {
      // Tokenizer, generation config, ...: everything but weights, index and config.
      for (const auto& e : fs::directory_iterator(in.copy_files_from, ec)) {
        const std::string name = e.path().filename().string();
        if (!e.is_regular_file() || e.path().extension() == ".safetensors" ||
            name == "model.safetensors.index.json" || name == "config.json") {
          continue;
        }
        fs::copy_file(e.path(), partial / name, fs::copy_options::overwrite_existing, ec);
        if (ec) {
          status = absl::InternalError(
              absl::StrCat("cannot copy ", e.path().string(), ": ", ec.message()));
          break;
        }
      }
    }
    // Swap the complete directory into place; an older one is removed last.
    if (status.ok()) status = PublishDirectory(partial, dir);
  }
  if (AnyRankFailed(world, !status.ok())) {
    return status.ok() ? absl::InternalError("rank 0 could not finish the directory") : status;
  }
  return absl::OkStatus();
}

}  // namespace moefit::framework
