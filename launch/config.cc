// Config loading, overrides and resolution; see config.h.
#include "launch/config.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "experts/registry.h"
#include "framework/adapter_io.h"
#include "framework/families/family.h"
#include "launch/config_fields.h"
#include "parallel/dispatcher.h"
#include "proto/status_macros.h"

namespace moefit::launch {

namespace pb = google::protobuf;

const char kDemoConfig[] = R"pb(
  model {
    model_type: "qwen3_moe"
    vocab_size: 256
    hidden_size: 128
    intermediate_size: 384
    moe_intermediate_size: 128
    num_hidden_layers: 4
    num_attention_heads: 4
    num_key_value_heads: 2
    head_dim: 32
    num_experts: 8
    num_experts_per_tok: 2
    norm_topk_prob: true
    router_aux_loss_coef: 0.01
    rope_theta: 10000
    max_position_embeddings: 1024
    tie_word_embeddings: false
  }
  train { steps: 400 micro_batch_size: 16 grad_accum_steps: 1 seq_len: 128 seed: 1234 }
  optimizer { lr: 3e-3 weight_decay: 0.1 beta1: 0.9 beta2: 0.95 eps: 1e-8 max_grad_norm: 1.0 }
  schedule { warmup_steps: 30 min_lr_ratio: 0.1 }
  logging { metrics_file: "moefit-metrics.jsonl" }
)pb";

namespace {

// Collects the first text-format error as "file:line:col: message".
class FirstError : public pb::io::ErrorCollector {
 public:
  explicit FirstError(std::string source) : source_(std::move(source)) {}
  void AddError(int line, pb::io::ColumnNumber column, const std::string& message) override {
    if (error_.empty())
      error_ = absl::StrCat(source_, ":", line + 1, ":", column + 1, ": ", message);
  }
  const std::string& error() const { return error_; }

 private:
  std::string source_;
  std::string error_;
};

absl::Status MergeText(const std::string& text, const std::string& source, pb::Message* msg) {
  FirstError errors(source);
  pb::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.MergeFromString(text, msg)) {
    return absl::InvalidArgumentError(errors.error().empty() ? source + ": cannot parse"
                                                             : errors.error());
  }
  return absl::OkStatus();
}

std::string FieldNames(const pb::Descriptor* d) {
  std::vector<std::string> names;
  for (int i = 0; i < d->field_count(); ++i) names.push_back(d->field(i)->name());
  return absl::StrJoin(names, ", ");
}

absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(what, ": cannot open '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::Status ApplyOverride(const std::string& assignment, proto::Config* config) {
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--set '", assignment, "': expected FIELD=VALUE, e.g. optimizer.lr=3e-4"));
  }
  const std::string path = assignment.substr(0, eq);
  std::string value = assignment.substr(eq + 1);
  pb::Message* msg = config;
  const std::vector<std::string> parts = absl::StrSplit(path, '.');
  for (size_t i = 0; i < parts.size(); ++i) {
    const pb::Descriptor* d = msg->GetDescriptor();
    const pb::FieldDescriptor* f = d->FindFieldByName(parts[i]);
    const std::string prefix = absl::StrJoin(parts.begin(), parts.begin() + i, ".");
    if (f == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--set ", assignment, ": unknown field '", parts[i], "' in ",
                       prefix.empty() ? "the config" : prefix, " (fields: ", FieldNames(d), ")"));
    }
    if (i + 1 < parts.size()) {
      if (f->cpp_type() != pb::FieldDescriptor::CPPTYPE_MESSAGE || f->is_repeated()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--set ", assignment, ": '", parts[i], "' is not a message"));
      }
      msg = msg->GetReflection()->MutableMessage(msg, f);
      continue;
    }
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      return absl::InvalidArgumentError(absl::StrCat("--set ", assignment, ": '", path,
                                                     "' is a message; set one of its fields (",
                                                     FieldNames(f->message_type()), ")"));
    }
    std::vector<std::string> values;
    if (f->is_repeated()) {
      absl::string_view v = absl::StripAsciiWhitespace(value);
      absl::ConsumePrefix(&v, "[");
      absl::ConsumeSuffix(&v, "]");
      for (absl::string_view item : absl::StrSplit(v, ',', absl::SkipWhitespace())) {
        values.emplace_back(absl::StripAsciiWhitespace(item));
      }
      msg->GetReflection()->ClearField(msg, f);
    } else {
      values.push_back(value);
    }
    for (std::string v : values) {
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING && !absl::StartsWith(v, "\"")) {
        v = absl::StrCat("\"", absl::CEscape(v), "\"");
      }
      FirstError ignored("--set");
      pb::TextFormat::Parser parser;
      parser.RecordErrorsTo(&ignored);
      if (!parser.ParseFieldValueFromString(v, f, msg)) {
        return absl::InvalidArgumentError(absl::StrCat("--set ", assignment, ": '", value,
                                                       "' is not a valid ", f->cpp_type_name(),
                                                       " for ", path));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// config.json keys moefit reads nothing from, each with the reason. Every
// other key either fills a ModelConfig field of the same name (after the
// family's renames), or is checked below, or stops the load: a key that
// changes the model's math must never be dropped without a word.
struct IgnoredKey {
  const char* key;
  const char* why;
};
constexpr IgnoredKey kIgnoredKeys[] = {
    {"architectures", "the family follows model_type"},
    {"auto_map", "no remote code is run"},
    {"transformers_version", "bookkeeping"},
    {"_name_or_path", "bookkeeping"},
    {"torch_dtype", "experts.dtype and checkpoint.save_dtype set the dtypes"},
    {"dtype", "experts.dtype and checkpoint.save_dtype set the dtypes"},
    {"use_cache", "training keeps no KV cache"},
    {"bos_token_id", "the data carries its tokens"},
    {"eos_token_id", "the data carries its tokens"},
    {"pad_token_id", "the data carries its tokens"},
    {"output_router_logits", "the balance loss follows router_aux_loss_coef"},
    {"pretraining_tp", "a tensor-parallel hint of the original training"},
    {"ep_size", "expert parallelism is parallel.ep_size"},
    {"qk_head_dim", "derived (qk_nope_head_dim + qk_rope_head_dim); checked"},
    {"sliding_window", "used only with use_sliding_window, which must be false"},
    {"max_window_layers", "used only with use_sliding_window, which must be false"},
    {"layer_types", "checked: every layer full attention"},
    {"rope_parameters", "read as rope_scaling / rope_theta / partial_rotary_factor"},
    {"num_mtp_layers", "read as num_nextn_predict_layers"},
    {"hidden_act", "checked: silu"},
    {"attention_dropout", "checked: 0"},
    {"router_jitter_noise", "checked: 0"},
    {"use_sliding_window", "checked: false"},
    {"mlp_bias", "checked: false"},
};

bool IsIgnored(const std::string& key) {
  return std::any_of(std::begin(kIgnoredKeys), std::end(kIgnoredKeys),
                     [&](const IgnoredKey& k) { return key == k.key; });
}

// The checked keys of kIgnoredKeys: values moefit does not implement stop the load.
absl::Status CheckUnsupportedValues(const std::string& path, const nlohmann::json& j) {
  auto bad = [&](const char* key, const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", key, " = ", j[key].dump(), " is not supported: ", why));
  };
  if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
    return bad("hidden_act", "moefit's MLPs and experts are SwiGLU (silu)");
  }
  for (const char* key : {"attention_dropout", "router_jitter_noise"}) {
    if (j.contains(key) && !j[key].is_null() && !(j[key].is_number() && j[key] == 0)) {
      return bad(key, "moefit has no dropout or router noise; set it to 0");
    }
  }
  for (const char* key : {"use_sliding_window", "mlp_bias"}) {
    if (j.contains(key) && j[key].is_boolean() && j[key].get<bool>()) {
      return bad(key, "moefit has no sliding-window attention or MLP biases");
    }
  }
  // Mixtral's config has no use_sliding_window: a window is on when given.
  if (j.contains("sliding_window") && !j["sliding_window"].is_null() &&
      !j.contains("use_sliding_window")) {
    return bad("sliding_window", "moefit has no sliding-window attention (set it to null)");
  }
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    for (const auto& t : j["layer_types"]) {
      if (t != "full_attention") return bad("layer_types", "every layer must be full_attention");
    }
  }
  auto integer = [&](const char* key) { return j.contains(key) && j[key].is_number_integer(); };
  if (integer("qk_head_dim") && integer("qk_nope_head_dim") && integer("qk_rope_head_dim") &&
      j["qk_head_dim"].get<int64_t>() !=
          j["qk_nope_head_dim"].get<int64_t>() + j["qk_rope_head_dim"].get<int64_t>()) {
    return bad("qk_head_dim", "it must equal qk_nope_head_dim + qk_rope_head_dim");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MergeHfConfigJson(const std::string& path, proto::ModelConfig* model) {
  MOEFIT_ASSIGN_OR_RETURN(std::string text, ReadFile(path, "model.config_json"));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  MOEFIT_RETURN_IF_ERROR(CheckUnsupportedValues(path, j));
  // Newer config.json files (transformers v5) keep the rotary settings under
  // rope_parameters; older ones use rope_theta, partial_rotary_factor and
  // rope_scaling at the top level. Both end up in the same fields.
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    const nlohmann::json& rp = j["rope_parameters"];
    // As transformers' standardize_rope_params: the value inside wins.
    for (const char* key : {"rope_theta", "partial_rotary_factor"}) {
      if (rp.contains(key) && !rp[key].is_null()) j[key] = rp[key];
    }
    if (!j.contains("rope_scaling") || j["rope_scaling"].is_null()) j["rope_scaling"] = rp;
  }
  if (j.contains("num_mtp_layers") && !j.contains("num_nextn_predict_layers")) {
    j["num_nextn_predict_layers"] = j["num_mtp_layers"];
  }
  // DeepSeek writes "q_lora_rank": null for queries without compression; keep
  // that apart from "not given" (which takes the family default).
  if (j.contains("q_lora_rank") && j["q_lora_rank"].is_null()) j["q_lora_rank"] = 0;
  // Family-specific key names (e.g. mixtral's num_local_experts).
  const std::string model_type = j.contains("model_type") && j["model_type"].is_string()
                                     ? j["model_type"].get<std::string>()
                                     : "";
  if (const framework::ModelFamily* f = framework::FindModelFamily(model_type);
      f != nullptr && f->from_hf_config != nullptr) {
    f->from_hf_config(j);
  }
  proto::ModelConfig from_json;
  const pb::Descriptor* d = proto::ModelConfig::descriptor();
  pb::util::JsonParseOptions jopts;
  // Inside rope_scaling and quantization_config: keys of types moefit does not
  // implement are reported by the resolution step, which names the type.
  jopts.ignore_unknown_fields = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const pb::FieldDescriptor* f = d->FindFieldByName(it.key());
    if (f == nullptr || it.key() == "config_json" || it.key() == "model_path") {
      if (IsIgnored(it.key())) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": key \"", it.key(), "\" = ", it.value().dump(),
          " is not read by moefit (neither a model field nor on the documented ignore list); "
          "remove it if it does not change the model"));
    }
    if (it.value().is_null()) continue;
    nlohmann::json one = {{it.key(), it.value()}};
    proto::ModelConfig part;
    if (!pb::util::JsonStringToMessage(one.dump(), &part, jopts).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": field ", it.key(), " = ",
                                                     it.value().dump(), " has the wrong type (",
                                                     f->cpp_type_name(), " expected)"));
    }
    from_json.MergeFrom(part);
  }
  if (model->mlp_only_layers_size() > 0) from_json.clear_mlp_only_layers();
  from_json.MergeFrom(*model);
  *model = std::move(from_json);
  return absl::OkStatus();
}

proto::Config DefaultConfig() {
  static const proto::Config* const defaults = [] {
    auto* config = new proto::Config;
    FillConfigDefaults(config);
    return config;
  }();
  return *defaults;
}

int64_t ShardBytes(int64_t given) {
  return given > 0 ? given : DefaultConfig().checkpoint().max_shard_bytes();
}

namespace {

// Applies the overrides to `config` (already merged onto the defaults), then
// the model's config.json.
absl::StatusOr<proto::Config> FinishConfig(proto::Config config,
                                           const std::vector<std::string>& overrides);

}  // namespace

absl::StatusOr<proto::Config> LoadConfig(const std::string& path,
                                         const std::vector<std::string>& overrides) {
  proto::Config config = DefaultConfig();
  if (path.empty()) {
    MOEFIT_RETURN_IF_ERROR(MergeText(kDemoConfig, "<demo config>", &config));
    // The demo run on another model: its shape comes from that model alone.
    for (const std::string& o : overrides) {
      if (absl::StartsWith(o, "model.model_path=") || absl::StartsWith(o, "model.config_json=")) {
        config.clear_model();
      }
    }
  } else {
    MOEFIT_ASSIGN_OR_RETURN(std::string text, ReadFile(path, "config"));
    MOEFIT_RETURN_IF_ERROR(MergeText(text, path, &config));
  }
  return FinishConfig(std::move(config), overrides);
}

absl::StatusOr<proto::Config> LoadConfigText(const std::string& text, const std::string& source,
                                             const std::vector<std::string>& overrides) {
  proto::Config config = DefaultConfig();
  MOEFIT_RETURN_IF_ERROR(MergeText(text, source, &config));
  return FinishConfig(std::move(config), overrides);
}

namespace {

absl::StatusOr<proto::Config> FinishConfig(proto::Config config,
                                           const std::vector<std::string>& overrides) {
  for (const std::string& o : overrides) MOEFIT_RETURN_IF_ERROR(ApplyOverride(o, &config));
  if (!config.model().model_path().empty() && config.model().config_json().empty()) {
    config.mutable_model()->set_config_json(
        (std::filesystem::path(config.model().model_path()) / "config.json").string());
  }
  if (!config.model().config_json().empty()) {
    MOEFIT_RETURN_IF_ERROR(MergeHfConfigJson(config.model().config_json(), config.mutable_model()));
  }
  return config;
}

}  // namespace

namespace {

absl::Status Invalid(const std::string& msg) { return absl::InvalidArgumentError(msg); }

absl::Status RequirePositive(const char* field, int64_t v) {
  if (v <= 0) return Invalid(absl::StrCat(field, " = ", v, " must be positive"));
  return absl::OkStatus();
}

// scoring_func / topk_method / groups / scaling / the balance losses.
absl::Status ResolveRouter(const proto::ModelConfig& m, framework::ModelOptions& o) {
  // The family fixes the router kind, as transformers' classes do: deepseek_v3
  // and glm4_moe always score with a sigmoid, pick with the correction bias
  // and group-limited top-k; the others use a softmax and no groups.
  const bool sigmoid = o.scoring == framework::RouterScoring::kSigmoid;
  if (m.has_scoring_func() && m.scoring_func() != (sigmoid ? "sigmoid" : "softmax")) {
    return Invalid(absl::StrCat(
        "model.scoring_func = '", m.scoring_func(), "' is not supported for ", o.model_type,
        " (its router scores with a ", sigmoid ? "sigmoid" : "softmax", ")"));
  }
  if (m.has_topk_method() && (!sigmoid || m.topk_method() != "noaux_tc")) {
    return Invalid(absl::StrCat("model.topk_method = '", m.topk_method(), "' is not supported for ",
                                o.model_type,
                                sigmoid ? " (its router is noaux_tc: correction bias and groups)"
                                        : " (its router is a plain softmax top-k)"));
  }
  if (!sigmoid && (o.n_group != 1 || o.topk_group != 1 || o.routed_scaling_factor != 1.0)) {
    return Invalid(
        absl::StrCat("model.n_group, topk_group and routed_scaling_factor apply to the "
                     "sigmoid routers of deepseek_v3 and glm4_moe, not to ",
                     o.model_type));
  }
  if (sigmoid && m.has_router_aux_loss_coef() && m.router_aux_loss_coef() > 0) {
    return Invalid(
        "model.router_aux_loss_coef: the Switch balance loss needs softmax scores; "
        "sigmoid routers use model.aux_loss_alpha (sequence-wise) and the correction "
        "bias");
  }
  if (o.moe_layer_freq != 1) {
    return Invalid(absl::StrCat("model.moe_layer_freq = ", o.moe_layer_freq,
                                " is not supported: experts are in every layer from "
                                "first_k_dense_replace on (as transformers builds these models)"));
  }
  MOEFIT_RETURN_IF_ERROR(RequirePositive("model.n_group", o.n_group));
  MOEFIT_RETURN_IF_ERROR(RequirePositive("model.topk_group", o.topk_group));
  if (o.num_experts % o.n_group != 0) {
    return Invalid(absl::StrCat("model.num_experts = ", o.num_experts,
                                " is not divisible by model.n_group = ", o.n_group));
  }
  if (o.topk_group > o.n_group) {
    return Invalid(
        absl::StrCat("model.topk_group = ", o.topk_group, " exceeds model.n_group = ", o.n_group));
  }
  const int64_t group_size = o.num_experts / o.n_group;
  if (o.n_group > 1 && group_size < 2) {
    return Invalid(absl::StrCat("model.n_group = ", o.n_group, " leaves ", group_size,
                                " expert per group; a group's score is its best two experts"));
  }
  if (o.num_experts_per_tok > o.topk_group * group_size) {
    return Invalid(absl::StrCat("model.num_experts_per_tok = ", o.num_experts_per_tok,
                                " exceeds the ", o.topk_group * group_size,
                                " experts of the model.topk_group = ", o.topk_group,
                                " groups a token may use"));
  }
  if (!(o.routed_scaling_factor > 0)) {
    return Invalid(absl::StrCat("model.routed_scaling_factor = ", o.routed_scaling_factor,
                                " must be positive"));
  }
  if (!sigmoid && o.aux_loss_alpha > 0) {
    return Invalid(
        absl::StrCat("model.aux_loss_alpha is the sequence-wise loss of sigmoid routers; ",
                     o.model_type, " uses model.router_aux_loss_coef"));
  }
  if (o.aux_loss_alpha < 0) {
    return Invalid(absl::StrCat("model.aux_loss_alpha = ", o.aux_loss_alpha, " must be >= 0"));
  }
  if (o.aux_loss_alpha > 0 && m.has_seq_aux() && !m.seq_aux()) {
    return Invalid(
        "model.seq_aux = false: moefit implements only the sequence-wise balance loss "
        "of aux_loss_alpha");
  }
  if (o.scoring == framework::RouterScoring::kSigmoid) o.router_aux_loss_coef = 0;
  return absl::OkStatus();
}

// rope_scaling: "default" or "yarn"; anything else is named and refused.
absl::Status ResolveRope(const proto::ModelConfig& m, framework::ModelOptions& o) {
  if (m.has_rope_scaling()) {
    const proto::RopeScalingConfig& r = m.rope_scaling();
    if (r.has_rope_theta() && !m.has_rope_theta()) o.rope_theta = r.rope_theta();
    if (r.has_partial_rotary_factor() && !m.has_partial_rotary_factor()) {
      o.partial_rotary_factor = r.partial_rotary_factor();
    }
    const std::string type = r.has_rope_type() ? r.rope_type()
                             : r.has_type()    ? r.type()
                                               : "default";
    framework::RopeScaling& s = o.rope_scaling;
    if (type == "yarn") {
      s.type = "yarn";
      s.original_max_position_embeddings = r.has_original_max_position_embeddings()
                                               ? r.original_max_position_embeddings()
                                               : o.max_position_embeddings;
      MOEFIT_RETURN_IF_ERROR(RequirePositive("model.rope_scaling.original_max_position_embeddings",
                                             s.original_max_position_embeddings));
      s.factor = r.has_factor() ? r.factor()
                                : static_cast<double>(o.max_position_embeddings) /
                                      static_cast<double>(s.original_max_position_embeddings);
      if (!(s.factor > 0)) {
        return Invalid(absl::StrCat("model.rope_scaling.factor = ", s.factor, " must be positive"));
      }
      if (r.has_beta_fast() && r.beta_fast() != 0) s.beta_fast = r.beta_fast();
      if (r.has_beta_slow() && r.beta_slow() != 0) s.beta_slow = r.beta_slow();
      if (!(s.beta_fast > 0) || !(s.beta_slow > 0)) {
        return Invalid(absl::StrCat("model.rope_scaling.beta_fast = ", s.beta_fast,
                                    " and beta_slow = ", s.beta_slow, " must be positive"));
      }
      if (!(o.rope_theta > 1)) {
        return Invalid(absl::StrCat("model.rope_theta = ", o.rope_theta,
                                    " must be above 1 with YaRN rotary scaling"));
      }
      s.mscale = r.mscale();
      s.mscale_all_dim = r.mscale_all_dim();
      if (r.has_attention_factor()) s.attention_factor = r.attention_factor();
      if (r.has_truncate()) s.truncate = r.truncate();
    } else if (type != "default") {
      return Invalid(absl::StrCat("model.rope_scaling type '", type,
                                  "' is not implemented by moefit (default or yarn)"));
    }
  }
  return absl::OkStatus();
}

// A google.protobuf.Value as config.json wrote it, for messages.
std::string JsonText(const google::protobuf::Value& v) {
  std::string out;
  if (!pb::util::MessageToJsonString(v, &out).ok()) return "?";
  return out;
}

bool IsNull(const google::protobuf::Value& v) {
  return v.kind_case() == google::protobuf::Value::KIND_NOT_SET ||
         v.kind_case() == google::protobuf::Value::kNullValue;
}

// quant_method "compressed-tensors": the schemes moefit reads, weight-only,
// stored compressed -- pack-quantized int4 in groups (Kimi-K2-Thinking's
// routed experts) and float-quantized FP8 in blocks -- each with the
// library's defaults for what a group leaves out. Anything else is refused
// naming its field.
absl::Status ResolveCompressedTensors(const proto::QuantizationConfig& q,
                                      framework::ModelOptions& o) {
  const std::string top = "model.quantization_config";
  auto bad = [](const std::string& field, const std::string& value, const std::string& why) {
    return Invalid(absl::StrCat(field, " = ", value, ": ", why));
  };
  auto quoted = [](const std::string& text) { return absl::StrCat("'", text, "'"); };
  for (const auto& [name, value] : {std::pair<const char*, const google::protobuf::Value*>{
                                        "sparsity_config", &q.sparsity_config()},
                                    {"transform_config", &q.transform_config()},
                                    {"moe_sparsity_config", &q.moe_sparsity_config()}}) {
    if (!IsNull(*value)) {
      return bad(absl::StrCat(top, ".", name), JsonText(*value),
                 "moefit reads quantized weights as stored, without sparsity, transforms or "
                 "pruned experts");
    }
  }
  if (q.has_kv_cache_scheme()) {
    return Invalid(absl::StrCat(top,
                                ".kv_cache_scheme is set: moefit does not quantize the attention's "
                                "keys and values (it must be null)"));
  }
  // The library's default status: not yet compressed.
  const std::string status = q.has_quantization_status() ? q.quantization_status() : "initialized";
  if (status != "compressed") {
    return bad(top + ".quantization_status", quoted(status),
               "moefit reads checkpoints stored compressed (\"compressed\")");
  }
  if (q.config_groups().empty()) {
    return Invalid(absl::StrCat(top, ".config_groups is empty: no quantized weights to read"));
  }
  std::vector<std::string> names;
  for (const auto& [name, scheme] : q.config_groups()) names.push_back(name);
  std::sort(names.begin(), names.end());
  std::optional<checkpoint::PackedInt4Format> int4;
  std::optional<std::array<int64_t, 2>> block;
  std::string int4_group, block_group;
  for (const std::string& name : names) {
    const proto::CompressedTensorsScheme& scheme = q.config_groups().at(name);
    const std::string group = absl::StrCat(top, ".config_groups.", name);
    for (const auto& [field, set] :
         {std::pair<const char*, bool>{"input_activations", scheme.has_input_activations()},
          {"output_activations", scheme.has_output_activations()}}) {
      if (set) {
        return Invalid(absl::StrCat(group, ".", field,
                                    " is set: moefit reads weight-only quantization (it must be "
                                    "null)"));
      }
    }
    if (!scheme.has_weights()) {
      return Invalid(absl::StrCat(group, ".weights is missing: the group quantizes no weights"));
    }
    const bool own_format = scheme.has_format();
    const std::string format_field = own_format ? group + ".format" : top + ".format";
    const bool has_format = own_format || q.has_format();
    const std::string format = own_format ? scheme.format() : q.format();
    const proto::CompressedTensorsArgs& w = scheme.weights();
    const std::string args = group + ".weights";
    const std::string type = w.has_type() ? w.type() : "int";
    const int64_t num_bits = w.has_num_bits() ? w.num_bits() : 8;
    const bool symmetric = !w.has_symmetric() || w.symmetric();
    const int64_t group_size = w.has_group_size() ? w.group_size() : 0;
    std::string strategy = w.has_strategy() ? w.strategy() : "";
    if (strategy.empty()) {
      strategy = group_size > 0 ? "group" : group_size == -1 ? "channel" : "tensor";
    }
    if (w.has_dynamic() && !IsNull(w.dynamic()) &&
        !(w.dynamic().has_bool_value() && !w.dynamic().bool_value())) {
      return bad(args + ".dynamic", JsonText(w.dynamic()),
                 "dynamic quantization stores no quantized weights; moefit reads static ones "
                 "(false)");
    }
    if (w.has_actorder() && !IsNull(w.actorder())) {
      const google::protobuf::Value& order = w.actorder();
      const bool calibration_only =
          (order.has_bool_value() && !order.bool_value()) ||
          (order.has_string_value() &&
           (order.string_value() == "weight" || order.string_value() == "static"));
      if (!calibration_only) {
        return bad(args + ".actorder", JsonText(order),
                   "this activation order stores permuted columns (weight_g_idx), which moefit "
                   "does not read (null, \"weight\" or \"static\")");
      }
    }
    if (w.has_scale_dtype() && w.scale_dtype() != "torch.bfloat16" &&
        w.scale_dtype() != "torch.float16" && w.scale_dtype() != "torch.float32") {
      return bad(args + ".scale_dtype", quoted(w.scale_dtype()),
                 "moefit reads scales in torch.bfloat16, torch.float16 or torch.float32");
    }
    if (format == "pack-quantized") {
      if (type != "int") {
        return bad(args + ".type", quoted(type),
                   "pack-quantized weights are read as integers (int)");
      }
      if (num_bits != 4) {
        return bad(args + ".num_bits", absl::StrCat(num_bits),
                   "pack-quantized weights are read as 4-bit integers");
      }
      if (strategy != "group") {
        return bad(args + ".strategy", quoted(strategy),
                   "pack-quantized int4 is read with one scale per group of inputs (group)");
      }
      if (group_size <= 0) {
        return bad(args + ".group_size", w.has_group_size() ? absl::StrCat(group_size) : "null",
                   "strategy group needs a positive group size");
      }
      if (!symmetric && w.has_zp_dtype() && w.zp_dtype() != "torch.int8") {
        return bad(args + ".zp_dtype", quoted(w.zp_dtype()),
                   "pack-quantized zero points are packed 4-bit integers (torch.int8)");
      }
      const checkpoint::PackedInt4Format format_of_group{.group_size = group_size,
                                                         .symmetric = symmetric};
      if (int4 && (int4->group_size != group_size || int4->symmetric != symmetric)) {
        return Invalid(absl::StrCat(
            group, ": int4 in groups of ", group_size, symmetric ? ", symmetric" : ", asymmetric",
            ", but config_groups.", int4_group, " is in groups of ", int4->group_size,
            int4->symmetric ? ", symmetric" : ", asymmetric",
            ": moefit reads one pack-quantized scheme per checkpoint"));
      }
      int4 = format_of_group;
      int4_group = name;
    } else if (format == "float-quantized") {
      if (type != "float") {
        return bad(args + ".type", quoted(type),
                   "float-quantized weights are read as 8-bit floats (float)");
      }
      if (num_bits != 8) {
        return bad(args + ".num_bits", absl::StrCat(num_bits),
                   "float-quantized weights are read as FP8 (e4m3)");
      }
      if (strategy != "block") {
        return bad(args + ".strategy", quoted(strategy),
                   "float-quantized FP8 is read with one scale per block (block)");
      }
      if (!symmetric) {
        return bad(args + ".symmetric", "false", "FP8 weights are read without zero points");
      }
      if (w.block_structure_size() != 2 || w.block_structure(0) <= 0 || w.block_structure(1) <= 0) {
        return bad(args + ".block_structure",
                   absl::StrCat("[", absl::StrJoin(w.block_structure(), ", "), "]"),
                   "must be two positive sizes [rows, cols]");
      }
      const std::array<int64_t, 2> b = {w.block_structure(0), w.block_structure(1)};
      if (block && *block != b) {
        return Invalid(absl::StrCat(group, ": FP8 blocks of [", b[0], ", ", b[1],
                                    "], but config_groups.", block_group, "'s are [", (*block)[0],
                                    ", ", (*block)[1],
                                    "]: moefit reads one FP8 block size per checkpoint"));
      }
      block = b;
      block_group = name;
    } else {
      return bad(format_field, has_format ? quoted(format) : "(not set)",
                 "moefit reads compressed-tensors' pack-quantized (int4) and float-quantized "
                 "(FP8 blocks) formats");
    }
  }
  o.int4_weights = int4;
  if (block) {
    o.fp8_weight_block = block;
    o.fp8_scale_suffix = std::string(checkpoint::kScaleSuffix);
  }
  return absl::OkStatus();
}

// quantization_config: FP8 e4m3 block-scaled checkpoints (dequantized on
// load, or kept for frozen experts), or compressed-tensors' schemes above.
absl::Status ResolveQuantization(const proto::ModelConfig& m, framework::ModelOptions& o) {
  if (!m.has_quantization_config()) return absl::OkStatus();
  const proto::QuantizationConfig& q = m.quantization_config();
  if (q.quant_method() == "compressed-tensors") return ResolveCompressedTensors(q, o);
  if (q.quant_method() != "fp8") {
    return Invalid(absl::StrCat("model.quantization_config.quant_method = '", q.quant_method(),
                                "' is not supported (moefit reads fp8 block-scaled and "
                                "compressed-tensors checkpoints)"));
  }
  if (!q.fmt().empty() && q.fmt() != "e4m3") {
    return Invalid(
        absl::StrCat("model.quantization_config.fmt = '", q.fmt(), "' is not supported (e4m3)"));
  }
  std::array<int64_t, 2> block = {128, 128};
  if (q.weight_block_size_size() != 0) {
    if (q.weight_block_size_size() != 2 || q.weight_block_size(0) <= 0 ||
        q.weight_block_size(1) <= 0) {
      return Invalid(
          "model.quantization_config.weight_block_size must be two positive sizes "
          "[rows, cols]");
    }
    block = {q.weight_block_size(0), q.weight_block_size(1)};
  }
  o.fp8_weight_block = block;
  return absl::OkStatus();
}

// Multi-head latent attention dims.
absl::Status ResolveMla(framework::ModelOptions& o) {
  for (auto [name, value] :
       std::vector<std::pair<const char*, int64_t>>{{"model.kv_lora_rank", o.kv_lora_rank},
                                                    {"model.qk_nope_head_dim", o.qk_nope_head_dim},
                                                    {"model.qk_rope_head_dim", o.qk_rope_head_dim},
                                                    {"model.v_head_dim", o.v_head_dim}}) {
    MOEFIT_RETURN_IF_ERROR(RequirePositive(name, value));
  }
  if (o.q_lora_rank < 0) {
    return Invalid(absl::StrCat("model.q_lora_rank = ", o.q_lora_rank,
                                " must be >= 0 (0 or null: no query compression)"));
  }
  if (o.qk_rope_head_dim % 2 != 0) {
    return Invalid(absl::StrCat("model.qk_rope_head_dim = ", o.qk_rope_head_dim,
                                " must be even (rotary embedding)"));
  }
  if (o.attention_bias) {
    return Invalid("model.attention_bias = true is not supported with multi-head latent attention");
  }
  // MLA has no key/value heads of its own: every head reads the shared latent.
  o.num_key_value_heads = o.num_attention_heads;
  o.head_dim = o.qk_rope_head_dim;  // what transformers reports as head_dim
  return absl::OkStatus();
}

absl::StatusOr<framework::ModelOptions> ResolveModel(const proto::ModelConfig& m) {
  if (!m.has_model_type()) {
    return Invalid(
        "model.model_type is not set (give it in the config or through model.config_json)");
  }
  const framework::ModelFamily* family = framework::FindModelFamily(m.model_type());
  if (family == nullptr) {
    std::vector<std::string> names;
    for (const auto& f : framework::ModelFamilies()) names.push_back(f.name);
    return Invalid(
        absl::StrCat("model.model_type = '", m.model_type(),
                     "' is not a supported family (supported: ", absl::StrJoin(names, ", "), ")"));
  }
  framework::ModelOptions o;
  family->set_defaults(o);
  o.model_type = family->name;
  if (m.model_type() != family->name) o.hf_model_type = m.model_type();
  // Required shape fields.
  struct Required {
    const char* name;
    bool has;
    int64_t value;
    int64_t* out;
  };
  const bool has_experts = m.has_num_experts() || m.has_num_local_experts();
  const int64_t experts = m.has_num_experts() ? m.num_experts() : m.num_local_experts();
  for (const Required& r : std::vector<Required>{
           {"model.vocab_size", m.has_vocab_size(), m.vocab_size(), &o.vocab_size},
           {"model.hidden_size", m.has_hidden_size(), m.hidden_size(), &o.hidden_size},
           {"model.num_hidden_layers", m.has_num_hidden_layers(), m.num_hidden_layers(),
            &o.num_hidden_layers},
           {"model.num_attention_heads", m.has_num_attention_heads(), m.num_attention_heads(),
            &o.num_attention_heads},
           {"model.num_experts", has_experts, experts, &o.num_experts},
           {"model.num_experts_per_tok", m.has_num_experts_per_tok(), m.num_experts_per_tok(),
            &o.num_experts_per_tok},
           {"model.moe_intermediate_size", m.has_moe_intermediate_size(), m.moe_intermediate_size(),
            &o.moe_intermediate_size},
       }) {
    if (!r.has) {
      return Invalid(absl::StrCat(r.name,
                                  " is not set (give it in the config or through "
                                  "model.config_json)"));
    }
    MOEFIT_RETURN_IF_ERROR(RequirePositive(r.name, r.value));
    *r.out = r.value;
  }
  if (m.has_intermediate_size()) o.intermediate_size = m.intermediate_size();
  if (m.has_shared_expert_intermediate_size())
    o.shared_expert_intermediate_size = m.shared_expert_intermediate_size();
  o.num_key_value_heads =
      m.has_num_key_value_heads() ? m.num_key_value_heads() : o.num_attention_heads;
  if (m.has_norm_topk_prob()) o.norm_topk_prob = m.norm_topk_prob();
  if (m.has_router_aux_loss_coef()) o.router_aux_loss_coef = m.router_aux_loss_coef();
  if (m.has_rope_theta()) o.rope_theta = m.rope_theta();
  if (m.has_rms_norm_eps()) o.rms_norm_eps = m.rms_norm_eps();
  o.mlp_only_layers.assign(m.mlp_only_layers().begin(), m.mlp_only_layers().end());
  if (m.has_decoder_sparse_step()) o.decoder_sparse_step = m.decoder_sparse_step();
  if (m.has_tie_word_embeddings()) o.tie_word_embeddings = m.tie_word_embeddings();
  if (m.has_max_position_embeddings()) o.max_position_embeddings = m.max_position_embeddings();
  if (m.has_initializer_range()) o.initializer_range = m.initializer_range();
  if (m.has_attention_bias()) o.attention_bias = m.attention_bias();
  if (m.has_partial_rotary_factor()) o.partial_rotary_factor = m.partial_rotary_factor();
  if (m.has_use_qk_norm()) o.qk_norm = m.use_qk_norm();
  if (m.has_q_lora_rank()) o.q_lora_rank = m.q_lora_rank();
  if (m.has_kv_lora_rank()) o.kv_lora_rank = m.kv_lora_rank();
  if (m.has_qk_nope_head_dim()) o.qk_nope_head_dim = m.qk_nope_head_dim();
  if (m.has_qk_rope_head_dim()) o.qk_rope_head_dim = m.qk_rope_head_dim();
  if (m.has_v_head_dim()) o.v_head_dim = m.v_head_dim();
  if (m.has_rope_interleave()) o.rope_interleave = m.rope_interleave();
  if (m.has_n_group()) o.n_group = m.n_group();
  if (m.has_topk_group()) o.topk_group = m.topk_group();
  if (m.has_routed_scaling_factor()) o.routed_scaling_factor = m.routed_scaling_factor();
  if (m.has_n_shared_experts()) o.n_shared_experts = m.n_shared_experts();
  if (m.has_first_k_dense_replace()) o.first_k_dense_replace = m.first_k_dense_replace();
  if (m.has_moe_layer_freq()) o.moe_layer_freq = m.moe_layer_freq();
  if (m.has_aux_loss_alpha()) o.aux_loss_alpha = m.aux_loss_alpha();
  if (m.has_num_nextn_predict_layers()) o.num_nextn_predict_layers = m.num_nextn_predict_layers();

  MOEFIT_RETURN_IF_ERROR(RequirePositive("model.num_key_value_heads", o.num_key_value_heads));
  if (o.num_experts_per_tok > o.num_experts) {
    return Invalid(absl::StrCat("model.num_experts_per_tok = ", o.num_experts_per_tok,
                                " exceeds model.num_experts = ", o.num_experts));
  }
  MOEFIT_RETURN_IF_ERROR(ResolveRouter(m, o));
  MOEFIT_RETURN_IF_ERROR(ResolveRope(m, o));
  MOEFIT_RETURN_IF_ERROR(ResolveQuantization(m, o));
  if (o.attention == framework::AttentionKind::kMla) {
    MOEFIT_RETURN_IF_ERROR(ResolveMla(o));
  } else if (m.has_head_dim()) {
    o.head_dim = m.head_dim();
    MOEFIT_RETURN_IF_ERROR(RequirePositive("model.head_dim", o.head_dim));
  } else {
    if (o.hidden_size % o.num_attention_heads != 0) {
      return Invalid(
          absl::StrCat("model.hidden_size = ", o.hidden_size,
                       " is not divisible by model.num_attention_heads = ", o.num_attention_heads));
    }
    o.head_dim = o.hidden_size / o.num_attention_heads;
  }
  if (o.attention == framework::AttentionKind::kGqa) {
    if (!(o.partial_rotary_factor > 0 && o.partial_rotary_factor <= 1)) {
      return Invalid(absl::StrCat("model.partial_rotary_factor = ", o.partial_rotary_factor,
                                  " must be in (0, 1]"));
    }
    if (o.rotary_dim() % 2 != 0 || o.rotary_dim() == 0) {
      return Invalid(absl::StrCat("model.head_dim = ", o.head_dim, " with partial_rotary_factor ",
                                  o.partial_rotary_factor, " gives ", o.rotary_dim(),
                                  " rotary dims; they must be even and positive"));
    }
  }
  if (o.num_attention_heads % o.num_key_value_heads != 0) {
    return Invalid(
        absl::StrCat("model.num_attention_heads = ", o.num_attention_heads,
                     " is not divisible by model.num_key_value_heads = ", o.num_key_value_heads));
  }
  for (int64_t l : o.mlp_only_layers) {
    if (l < 0 || l >= o.num_hidden_layers) {
      return Invalid(absl::StrCat("model.mlp_only_layers holds ", l, ", outside [0, ",
                                  o.num_hidden_layers, ")"));
    }
  }
  MOEFIT_RETURN_IF_ERROR(RequirePositive("model.decoder_sparse_step", o.decoder_sparse_step));
  bool any_dense = false;
  for (int64_t l = 0; l < o.num_hidden_layers; ++l) any_dense |= !o.IsMoeLayer(l);
  if (any_dense && o.intermediate_size <= 0) {
    return Invalid(absl::StrCat("model.intermediate_size = ", o.intermediate_size,
                                " must be positive: the model has dense MLP layers"));
  }
  if (o.shared_expert_intermediate_size < 0) {
    return Invalid(absl::StrCat("model.shared_expert_intermediate_size = ",
                                o.shared_expert_intermediate_size, " must be >= 0"));
  }
  if (o.rms_norm_eps <= 0) {
    return Invalid(absl::StrCat("model.rms_norm_eps = ", o.rms_norm_eps, " must be positive"));
  }
  if (o.rope_theta <= 0) {
    return Invalid(absl::StrCat("model.rope_theta = ", o.rope_theta, " must be positive"));
  }
  if (o.router_aux_loss_coef < 0) {
    return Invalid(
        absl::StrCat("model.router_aux_loss_coef = ", o.router_aux_loss_coef, " must be >= 0"));
  }
  if (o.first_k_dense_replace < 0 || o.first_k_dense_replace > o.num_hidden_layers) {
    return Invalid(absl::StrCat("model.first_k_dense_replace = ", o.first_k_dense_replace,
                                " must be in [0, model.num_hidden_layers = ", o.num_hidden_layers,
                                "]"));
  }
  MOEFIT_RETURN_IF_ERROR(RequirePositive("model.moe_layer_freq", o.moe_layer_freq));
  if (o.num_nextn_predict_layers < 0) {
    return Invalid(absl::StrCat("model.num_nextn_predict_layers = ", o.num_nextn_predict_layers,
                                " must be >= 0"));
  }
  if (o.n_shared_experts < 0) {
    return Invalid(absl::StrCat("model.n_shared_experts = ", o.n_shared_experts, " must be >= 0"));
  }
  return o;
}

}  // namespace

absl::StatusOr<framework::ModelOptions> ResolveModelConfig(const proto::ModelConfig& model) {
  return ResolveModel(model);
}

namespace {

absl::StatusOr<std::optional<at::ScalarType>> OptionalDtype(const std::string& field,
                                                            const std::string& value) {
  if (value.empty()) return std::optional<at::ScalarType>();
  if (value == "float32") return std::optional<at::ScalarType>(at::kFloat);
  if (value == "bfloat16") return std::optional<at::ScalarType>(at::kBFloat16);
  return Invalid(absl::StrCat(field, " = '", value, "' must be float32 or bfloat16 (or empty)"));
}

// train.mode, train.recompute and the lora message. An adapter directory
// (init_from or adapter_path) supplies rank, alpha, rslora and targets; a
// value set here too must agree with it.
absl::Status ResolveLora(const proto::Config& c, RunConfig& run) {
  const std::string& recompute = c.train().recompute();
  if (recompute.empty() || recompute == "none") {
    run.runtime.recompute = framework::Recompute::kNone;
  } else if (recompute == "experts") {
    run.runtime.recompute = framework::Recompute::kExperts;
  } else if (recompute == "full") {
    run.runtime.recompute = framework::Recompute::kFull;
  } else {
    return Invalid(
        absl::StrCat("train.recompute = '", recompute, "' must be none, experts or full"));
  }
  const proto::LoraConfig& l = c.lora();
  const std::string& mode = c.train().mode();
  if (!mode.empty() && mode != "full" && mode != "lora") {
    return Invalid(absl::StrCat("train.mode = '", mode, "' must be full or lora"));
  }
  if (!l.init_from().empty() && !l.adapter_path().empty()) {
    return Invalid("lora.init_from and lora.adapter_path name two adapters: give one");
  }
  const std::string adapter_dir = !l.init_from().empty() ? l.init_from() : l.adapter_path();
  // An adapter to apply (eval, merge) makes a LoRA model whatever train.mode says.
  const bool lora = mode == "lora" || !l.adapter_path().empty();
  if (!lora) {
    if (l.has_rank() || l.has_alpha() || l.has_dropout() || l.has_use_rslora() ||
        l.target_modules_size() > 0 || !l.init_from().empty() || !l.base_dtype().empty() ||
        l.save_per_expert()) {
      return Invalid("lora.* is set but train.mode is not lora (set train.mode=lora)");
    }
    return absl::OkStatus();
  }
  if (mode == "full") {
    return Invalid(
        "lora.adapter_path applies an adapter to a frozen model (moefit eval, merge); "
        "train.mode = 'full' trains every weight: drop one of them");
  }
  if (!c.checkpoint().save_dtype().empty()) {
    return Invalid(
        "checkpoint.save_dtype applies to model saves; in train.mode lora the adapter "
        "is written in float32");
  }
  framework::LoraOptions& o = run.runtime.lora;
  o.rank = l.has_rank() ? l.rank() : 0;
  o.alpha = DoubleOrDefault(l, "alpha");
  o.dropout = DoubleOrDefault(l, "dropout");
  o.use_rslora = l.has_use_rslora() && l.use_rslora();
  o.target_modules.assign(l.target_modules().begin(), l.target_modules().end());
  if (!adapter_dir.empty()) {
    absl::StatusOr<framework::AdapterConfig> a = framework::ReadAdapterConfig(adapter_dir);
    if (!a.ok()) return a.status();
    const std::string from = absl::StrCat(" but the adapter ", adapter_dir, " says ");
    if (l.has_rank() && l.rank() != a->r) {
      return Invalid(absl::StrCat("lora.rank = ", l.rank(), from, "r = ", a->r));
    }
    if (l.has_alpha() && l.alpha() != a->lora_alpha) {
      return Invalid(
          absl::StrCat("lora.alpha = ", l.alpha(), from, "lora_alpha = ", a->lora_alpha));
    }
    if (l.has_use_rslora() && l.use_rslora() != a->use_rslora) {
      return Invalid(
          absl::StrCat("lora.use_rslora = ", l.use_rslora(), from, "use_rslora = ", a->use_rslora));
    }
    // Parameters of dense modules name the module ("mlp.gate_proj.weight").
    std::vector<std::string> targets = a->target_modules;
    for (const std::string& p : a->target_parameters) {
      targets.push_back(p.ends_with(".weight") ? p.substr(0, p.size() - 7) : p);
    }
    if (l.target_modules_size() > 0) {
      auto mine = framework::ResolveLoraTargets(run.model, o.target_modules);
      auto theirs = framework::ResolveLoraTargets(run.model, targets);  // the adapter's
      if (!mine.ok()) return mine.status();
      if (!theirs.ok()) {
        return Invalid(
            absl::StrCat(adapter_dir, "/adapter_config.json: ", theirs.status().message()));
      }
      if (mine->modules != theirs->modules || mine->expert_gate_up != theirs->expert_gate_up ||
          mine->expert_down != theirs->expert_down) {
        return Invalid(absl::StrCat("lora.target_modules = [",
                                    absl::StrJoin(o.target_modules, ", "), "]", from, "[",
                                    absl::StrJoin(targets, ", "), "]"));
      }
    }
    o.rank = a->r;
    o.alpha = a->lora_alpha;
    o.use_rslora = a->use_rslora;
    if (!l.has_dropout()) o.dropout = a->lora_dropout;
    o.target_modules = targets;
  }
  if (o.rank <= 0) return Invalid(absl::StrCat("lora.rank = ", o.rank, " must be positive"));
  if (!(o.alpha > 0)) return Invalid(absl::StrCat("lora.alpha = ", o.alpha, " must be positive"));
  if (o.dropout < 0 || o.dropout >= 1) {
    return Invalid(absl::StrCat("lora.dropout = ", o.dropout, " must be in [0, 1)"));
  }
  if (o.target_modules.empty()) {
    return Invalid(
        "lora.target_modules is empty: name the modules to adapt (e.g. q_proj, "
        "v_proj, experts)");
  }
  absl::StatusOr<framework::LoraTargets> targets =
      framework::ResolveLoraTargets(run.model, o.target_modules);
  if (!targets.ok() && !adapter_dir.empty() && l.target_modules_size() == 0) {
    return Invalid(absl::StrCat(adapter_dir,
                                "/adapter_config.json: its targets do not fit this "
                                "model: ",
                                targets.status().message()));
  }
  if (!targets.ok()) return targets.status();
  run.lora_init_from = adapter_dir;
  run.lora_adapter_only = !l.adapter_path().empty();
  run.lora_save_per_expert = l.save_per_expert();
  MOEFIT_ASSIGN_OR_RETURN(run.lora_base_dtype, OptionalDtype("lora.base_dtype", l.base_dtype()));
  // The correction biases are base state an adapter cannot carry.
  if (c.router().has_bias_update_rate() && c.router().bias_update_rate() > 0 &&
      run.model.correction_bias) {
    return Invalid(
        "router.bias_update_rate: the correction biases are frozen with the base in "
        "train.mode lora (an adapter cannot carry them); leave it unset or 0");
  }
  run.train.bias_update_rate = 0;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RunConfig> ResolveConfig(const proto::Config& c) {
  RunConfig run;
  MOEFIT_ASSIGN_OR_RETURN(run.model, ResolveModel(c.model()));

  // Every number against its range in proto/config.proto.
  MOEFIT_RETURN_IF_ERROR(CheckConfigRanges(c));

  const proto::TrainConfig& t = c.train();
  if (t.seq_len() > run.model.max_position_embeddings) {
    return Invalid(absl::StrCat(
        "train.seq_len = ", t.seq_len(),
        " exceeds model.max_position_embeddings = ", run.model.max_position_embeddings));
  }
  run.seq_len = t.seq_len();
  run.train.steps = t.steps();
  run.train.micro_batch_size = t.micro_batch_size();
  run.train.grad_accum_steps = t.grad_accum_steps();
  run.train.seed = t.seed();

  const proto::OptimizerConfig& op = c.optimizer();
  run.train.optimizer = {op.lr(),
                         op.weight_decay(),
                         op.beta1(),
                         op.beta2(),
                         op.eps(),
                         op.max_grad_norm(),
                         op.stochastic_rounding()};
  const proto::ScheduleConfig& sc = c.schedule();
  run.train.schedule = {sc.warmup_steps(), sc.min_lr_ratio()};
  run.train.bias_update_rate = DoubleOrDefault(c.router(), "bias_update_rate");
  run.train.metrics_file = c.logging().metrics_file();
  run.train.log_every = c.logging().log_every();
  const proto::LoggingConfig& lg = c.logging();
  run.train.routing_telemetry = lg.routing_telemetry();
  run.train.routing_half_life_steps = lg.routing_half_life_steps();
  run.train.tensorboard_dir = lg.tensorboard_dir();
  if (lg.expert_map_every_steps() > 0) {
    if (!run.train.routing_telemetry) {
      return Invalid(
          "logging.expert_map_every_steps draws the decayed counters of "
          "logging.routing_telemetry, which is off");
    }
    if (run.train.metrics_file.empty() && run.train.tensorboard_dir.empty()) {
      return Invalid(
          "logging.expert_map_every_steps writes the map beside logging.metrics_file or into "
          "logging.tensorboard_dir, and neither is set");
    }
    run.train.expert_map_every_steps = lg.expert_map_every_steps();
    if (!run.train.metrics_file.empty()) {
      const std::filesystem::path dir = std::filesystem::path(run.train.metrics_file).parent_path();
      run.train.expert_map_dir = dir.empty() ? "." : dir.string();
    }
  }

  const proto::ExpertsConfig& e = c.experts();
  const std::vector<std::string> backends = experts::ExpertBackendNames();
  if (std::find(backends.begin(), backends.end(), e.backend()) == backends.end()) {
    return Invalid(absl::StrCat("experts.backend = '", e.backend(),
                                "' is unknown (known: ", absl::StrJoin(backends, ", "), ")"));
  }
  run.runtime.expert_backend = e.backend();
  if (e.dtype() == "float32" || e.dtype().empty()) {
    run.runtime.expert_dtype = at::kFloat;
  } else if (e.dtype() == "bfloat16") {
    run.runtime.expert_dtype = at::kBFloat16;
  } else if (e.dtype() == "float8_e4m3fn") {
    run.runtime.expert_dtype = at::kFloat8_e4m3fn;
  } else if (e.dtype() == "int4") {
    run.runtime.expert_dtype = at::kByte;
  } else {
    return Invalid(absl::StrCat("experts.dtype = '", e.dtype(),
                                "' must be float32, bfloat16, float8_e4m3fn or int4 (or empty)"));
  }
  run.experts_dtype_set = !e.dtype().empty();
  MOEFIT_RETURN_IF_ERROR(ResolveLora(c, run));
  run.runtime.expert_threads = e.num_threads();
  if (e.thread_pool() == "openmp" || e.thread_pool().empty()) {
    run.runtime.expert_thread_pool = experts::ThreadPool::kOpenMp;
  } else if (e.thread_pool() == "onetbb") {
    run.runtime.expert_thread_pool = experts::ThreadPool::kOneTbb;
  } else {
    return Invalid(absl::StrCat("experts.thread_pool = '", e.thread_pool(),
                                "' must be openmp or onetbb (or empty)"));
  }
  // Up to 1 PiB, so that the bytes fit an int64.
  if (!(e.packed_weight_gb() >= 0 && e.packed_weight_gb() <= (1 << 20))) {
    return Invalid(absl::StrCat("experts.packed_weight_gb = ", e.packed_weight_gb(),
                                " must be between 0 and 1048576 (GiB; 0: pack on every call)"));
  }
  run.runtime.expert_packed_bytes = static_cast<int64_t>(e.packed_weight_gb() * (int64_t{1} << 30));
  run.train.gpu_cache_every_steps = e.gpu_cache_every_steps();
  if (e.gpu_cache_experts() > 0) {
    if (!run.train.routing_telemetry) {
      return Invalid(
          "experts.gpu_cache_experts chooses experts by the decayed counters of "
          "logging.routing_telemetry, which is off");
    }
    run.train.gpu_cache_experts = e.gpu_cache_experts();
  }

  const std::string& dev = c.parallel().device();
  if (dev == "auto") {
    run.runtime.dense_device = torch::cuda::is_available() ? c10::Device(c10::kCUDA) : c10::kCPU;
  } else if (dev == "cpu") {
    run.runtime.dense_device = c10::kCPU;
  } else if (dev == "cuda") {
    if (!torch::cuda::is_available()) {
      return absl::FailedPreconditionError(
          "parallel.device = 'cuda' but LibTorch sees no CUDA device here");
    }
    run.runtime.dense_device = c10::Device(c10::kCUDA);
  } else {
    return Invalid(absl::StrCat("parallel.device = '", dev, "' must be auto, cpu or cuda"));
  }
  if (run.train.gpu_cache_experts > 0 && !run.runtime.dense_device.is_cuda()) {
    return Invalid(absl::StrCat("experts.gpu_cache_experts = ", run.train.gpu_cache_experts,
                                " computes hot experts on the process's GPU, and this run has none "
                                "(parallel.device = '",
                                dev, "'", dev == "auto" ? ", and LibTorch sees no CUDA device" : "",
                                ")"));
  }

  run.ep_size = c.parallel().ep_size();
  const std::vector<std::string> dispatchers = parallel::DispatcherNames();
  if (std::find(dispatchers.begin(), dispatchers.end(), c.parallel().dispatcher()) ==
      dispatchers.end()) {
    return Invalid(absl::StrCat("parallel.dispatcher = '", c.parallel().dispatcher(),
                                "' is unknown (known: ", absl::StrJoin(dispatchers, ", "), ")"));
  }
  run.runtime.dispatcher = c.parallel().dispatcher();
  run.runtime.dispatch_chunks = c.parallel().dispatch_chunks();
  run.progress_thread_us = c.parallel().progress_thread_us();
  for (const auto& [name, seconds] :
       {std::pair<const char*, double>{"parallel.timeout_s", c.parallel().timeout_s()},
        {"parallel.startup_timeout_s", c.parallel().startup_timeout_s()}}) {
    // A deadline is what keeps a job from hanging: it cannot be switched off.
    if (!(seconds > 0) || !std::isfinite(seconds)) {
      return Invalid(absl::StrCat(name, " = ", seconds, " must be a positive number of seconds"));
    }
  }
  const std::string& dense_dtype = c.train().dense_dtype();
  if (dense_dtype == "float32" || dense_dtype.empty()) {
    run.train.dense_autocast = at::kFloat;
  } else if (dense_dtype == "bfloat16") {
    run.train.dense_autocast = at::kBFloat16;
  } else {
    return Invalid(
        absl::StrCat("train.dense_dtype = '", dense_dtype, "' must be float32 or bfloat16"));
  }
  for (const auto& [field, on] :
       {std::pair<const char*, bool>{"train.dense_dtype = 'bfloat16'",
                                     run.train.dense_autocast != at::kFloat},
        {"train.allow_tf32", c.train().allow_tf32()}}) {
    if (on && !run.runtime.dense_device.is_cuda()) {
      return absl::FailedPreconditionError(
          absl::StrCat(field,
                       " applies to the dense layers on a GPU, but they run on the CPU here "
                       "(parallel.device = '",
                       dev, "'", dev == "auto" ? ": LibTorch sees no CUDA device" : "", ")"));
    }
  }
  if (run.train.dense_autocast != at::kFloat &&
      run.runtime.recompute == framework::Recompute::kFull) {
    // The layers would run again in backward, outside the forward's autocast.
    return Invalid(
        "train.dense_dtype = 'bfloat16' cannot be combined with train.recompute = 'full'; use "
        "train.recompute = 'experts' or 'none'");
  }
  run.train.allow_tf32 = c.train().allow_tf32();
  run.ranks_per_gpu = c.parallel().ranks_per_gpu();
  if (c.parallel().grad_sync() == "overlap") {
    run.train.overlap_grad_sync = true;
  } else if (c.parallel().grad_sync() == "after_backward") {
    run.train.overlap_grad_sync = false;
  } else {
    return Invalid(absl::StrCat("parallel.grad_sync = '", c.parallel().grad_sync(),
                                "' must be overlap or after_backward"));
  }
  run.train.grad_bucket_bytes = c.parallel().grad_bucket_bytes();
  run.timeout_s = c.parallel().timeout_s();
  run.startup_timeout_s = c.parallel().startup_timeout_s();

  run.model_path = c.model().model_path();
  run.base_config_json = c.model().config_json();
  run.save_dir = c.checkpoint().save_dir();
  run.max_shard_bytes = c.checkpoint().max_shard_bytes();
  if (c.checkpoint().save_dtype() == "float32") {
    run.save_dtype = at::kFloat;
  } else if (c.checkpoint().save_dtype() == "bfloat16") {
    run.save_dtype = at::kBFloat16;
  } else if (!c.checkpoint().save_dtype().empty()) {
    return Invalid(absl::StrCat("checkpoint.save_dtype = '", c.checkpoint().save_dtype(),
                                "' must be float32 or bfloat16 (or empty: as trained)"));
  }

  const proto::CheckpointConfig& ck = c.checkpoint();
  run.save_every_steps = ck.save_every_steps();
  run.save_every_minutes = ck.save_every_minutes();
  run.keep_last = ck.keep_last();
  run.resume_from = ck.resume_from();
  if (run.training_checkpoints() && run.save_dir.empty()) {
    return Invalid(
        "checkpoint.save_every_steps / save_every_minutes write training checkpoints under "
        "checkpoint.save_dir, which is not set");
  }
  if (ck.has_keep_last() && !run.training_checkpoints()) {
    return Invalid(
        "checkpoint.keep_last applies to training checkpoints: set checkpoint.save_every_steps "
        "or checkpoint.save_every_minutes");
  }
  google::protobuf::TextFormat::PrintToString(c, &run.config_text);
  run.model_config = c.model();

  run.data = {c.data().format(), c.data().path()};
  if (run.data.format == "text") {
    if (run.model.vocab_size < framework::kByteVocabSize) {
      return Invalid(absl::StrCat("model.vocab_size = ", run.model.vocab_size,
                                  " is smaller than the byte tokenizer's ",
                                  framework::kByteVocabSize, " tokens (data.format = text)"));
    }
  } else if (run.data.format == "jsonl") {
    if (run.data.path.empty()) return Invalid("data.path is not set (data.format = jsonl)");
  } else {
    return Invalid(absl::StrCat("data.format = '", run.data.format, "' must be text or jsonl"));
  }
  return run;
}

}  // namespace moefit::launch
