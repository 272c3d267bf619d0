// The config schema's defaults and ranges: every stated default parses and
// lies in its field's range, the defaults land in the config and in the
// resolved run, and values outside a range get one message form.
#include "launch/config_fields.h"

#include <c10/util/Exception.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>

#include "absl/strings/numbers.h"
#include "launch/config.h"

namespace moefit::launch {
namespace {

namespace pb = google::protobuf;

TEST(ConfigFields, EveryDefaultParsesAndLiesInItsRange) {
  const pb::Descriptor& config = *proto::Config::descriptor();
  int defaults = 0, ranges = 0;
  for (int i = 0; i < config.field_count(); ++i) {
    const pb::Descriptor* section = config.field(i)->message_type();
    ASSERT_NE(section, nullptr);
    for (int j = 0; j < section->field_count(); ++j) {
      const pb::FieldDescriptor& f = *section->field(j);
      const std::string value = DefaultValueOf(f), range = RangeOf(f);
      if (!value.empty()) {
        ++defaults;
        std::unique_ptr<pb::Message> m(
            pb::MessageFactory::generated_factory()->GetPrototype(section)->New());
        EXPECT_TRUE(SetToDefault(f, m.get())) << f.full_name() << " = " << value;
        if (!range.empty()) {
          double v = 0;
          ASSERT_TRUE(absl::SimpleAtod(value, &v)) << f.full_name();
          EXPECT_TRUE(ParseFieldRange(range).Contains(v)) << f.full_name() << " = " << value;
        }
      }
      if (!range.empty()) {
        ++ranges;
        EXPECT_NO_THROW(ParseFieldRange(range)) << f.full_name();
      }
      EXPECT_FALSE(DefaultWhenAbsent(f) && value.empty())
          << f.full_name() << " is read with its default but states none";
    }
  }
  EXPECT_GE(defaults, 30);
  EXPECT_GE(ranges, 20);
}

TEST(ConfigFields, RangesReadAndDescribeThemselves) {
  const FieldRange positive = ParseFieldRange("> 0");
  EXPECT_EQ(positive.Describe(), "positive");
  EXPECT_FALSE(positive.Contains(0));
  EXPECT_TRUE(positive.Contains(1e-300));
  EXPECT_FALSE(positive.Contains(std::nan("")));
  const FieldRange at_least = ParseFieldRange(">= 2");
  EXPECT_EQ(at_least.Describe(), ">= 2");
  EXPECT_TRUE(at_least.Contains(2));
  EXPECT_FALSE(at_least.Contains(1.5));
  const FieldRange half_open = ParseFieldRange("[0, 1)");
  EXPECT_EQ(half_open.Describe(), "in [0, 1)");
  EXPECT_TRUE(half_open.Contains(0));
  EXPECT_FALSE(half_open.Contains(1));
  const FieldRange closed = ParseFieldRange("[0, 1]");
  EXPECT_TRUE(closed.Contains(1));
  EXPECT_FALSE(closed.Contains(-0.5));
  const FieldRange noted = ParseFieldRange(">= 0 (0 = off)");
  EXPECT_EQ(noted.Describe(), ">= 0 (0 = off)");
  EXPECT_TRUE(ParseFieldRange(">= 1").Contains(std::numeric_limits<double>::infinity()));
  EXPECT_THROW(ParseFieldRange("0 to 1"), c10::Error);
  EXPECT_THROW(ParseFieldRange("[0]"), c10::Error);
}

TEST(ConfigFields, DefaultsFillTheConfigButNotThoseReadWhenAbsent) {
  const proto::Config c = DefaultConfig();
  EXPECT_DOUBLE_EQ(c.optimizer().lr(), 3e-4);
  EXPECT_DOUBLE_EQ(c.optimizer().beta2(), 0.95);
  EXPECT_EQ(c.train().seq_len(), 256);
  EXPECT_EQ(c.experts().backend(), "grouped");
  EXPECT_EQ(c.parallel().grad_bucket_bytes(), 32 << 20);
  EXPECT_DOUBLE_EQ(c.parallel().timeout_s(), 300);
  EXPECT_TRUE(c.logging().routing_telemetry());
  EXPECT_EQ(c.checkpoint().max_shard_bytes(), 5'000'000'000);
  // Absence means something for these: they stay unset, read with the default.
  EXPECT_FALSE(c.router().has_bias_update_rate());
  EXPECT_FALSE(c.lora().has_alpha());
  EXPECT_FALSE(c.model().has_vocab_size());
  EXPECT_DOUBLE_EQ(DoubleOrDefault(c.router(), "bias_update_rate"), 0.001);
  proto::RouterTrainingConfig set;
  set.set_bias_update_rate(0);
  EXPECT_DOUBLE_EQ(DoubleOrDefault(set, "bias_update_rate"), 0);
}

TEST(ConfigFields, TheResolvedRunCarriesTheSchemasDefaults) {
  absl::StatusOr<proto::Config> c = LoadConfigText(
      "", "<empty>",
      {"model.model_type=qwen3_moe", "model.vocab_size=256", "model.hidden_size=64",
       "model.intermediate_size=64", "model.moe_intermediate_size=32", "model.num_hidden_layers=1",
       "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.head_dim=32",
       "model.num_experts=4", "model.num_experts_per_tok=2", "model.max_position_embeddings=512"});
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<RunConfig> run = ResolveConfig(*c);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_DOUBLE_EQ(run->train.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(run->train.optimizer.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(run->train.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(run->train.schedule.min_lr_ratio, 0.1);
  EXPECT_EQ(run->train.steps, 100);
  EXPECT_EQ(run->train.micro_batch_size, 8);
  EXPECT_EQ(run->seq_len, 256);
  EXPECT_DOUBLE_EQ(run->train.bias_update_rate, 0.001);
  EXPECT_TRUE(run->train.overlap_grad_sync);
  EXPECT_EQ(run->train.grad_bucket_bytes, 32 << 20);
  EXPECT_DOUBLE_EQ(run->train.routing_half_life_steps, 50);
  EXPECT_EQ(run->ranks_per_gpu, 1);
  EXPECT_DOUBLE_EQ(run->timeout_s, 300);
  EXPECT_DOUBLE_EQ(run->startup_timeout_s, 1800);
  EXPECT_EQ(run->max_shard_bytes, 5'000'000'000);
}

TEST(ConfigFields, AValueOutsideItsRangeIsNamedWithItsRange) {
  proto::Config c = DefaultConfig();
  EXPECT_TRUE(CheckConfigRanges(c).ok());
  c.mutable_schedule()->set_min_lr_ratio(1.5);
  EXPECT_EQ(CheckConfigRanges(c).message(), "schedule.min_lr_ratio = 1.5 must be in [0, 1]");
  c = DefaultConfig();
  c.mutable_checkpoint()->set_keep_last(-2);
  EXPECT_EQ(CheckConfigRanges(c).message(),
            "checkpoint.keep_last = -2 must be >= 0 (0 = keep all)");
  // An unset field with explicit presence is not checked: it takes a value
  // elsewhere (keep_last absent = 0; bias_update_rate its default).
  c = DefaultConfig();
  EXPECT_FALSE(c.checkpoint().has_keep_last());
  EXPECT_TRUE(CheckConfigRanges(c).ok());
  c.mutable_router()->set_bias_update_rate(-0.5);
  EXPECT_EQ(CheckConfigRanges(c).message(), "router.bias_update_rate = -0.5 must be >= 0");
}

}  // namespace
}  // namespace moefit::launch
