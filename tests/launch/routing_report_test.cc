// moefit routing-report: N processes print and write the report of one
// process (the per-sequence counts are exact sums, the bootstrap runs on
// rank 0 from the same seed); the report's figures hold together (each
// layer's shares sum to num_experts_per_tok, intervals around the shares);
// a source unlike the other (digits against English prose) draws experts
// that take a larger share of it than of the prose, with intervals that say
// so; sources are read as documented, and bad ones refused by name.
// Runs under mpirun -np 2.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "launch/config.h"
#include "launch/corpus.h"
#include "launch/routing_report_command.h"
#include "parallel/local_communicator.h"
#include "tests/parallel/mpi_test_env.h"

namespace moefit::launch {
namespace {

std::string Temp(const std::string& name) {
  return ::testing::TempDir() + "/routing_report_" +
         std::to_string(parallel::testing::World()->rank()) + "_" + name;
}

RunConfig SmallRun() {
  auto c = LoadConfig("", {"train.seq_len=64", "model.hidden_size=64", "model.head_dim=16",
                           "model.moe_intermediate_size=32", "model.num_hidden_layers=2",
                           "train.micro_batch_size=3", "train.seed=5", "logging.metrics_file="});
  EXPECT_TRUE(c.ok()) << c.status();
  auto r = ResolveConfig(*c);
  EXPECT_TRUE(r.ok()) << r.status();
  r->runtime.expert_threads = 1;
  return *r;
}

// Two sources: English prose (the shipped corpus) and lines of digits.
std::vector<std::string> Sources() {
  const std::string prose = Temp("prose.txt"), digits = Temp("digits.jsonl");
  std::ofstream(prose) << std::string(ShippedCorpus().substr(0, 64 * 40));
  std::ofstream f(digits);
  for (int line = 0; line < 30; ++line) {
    f << "{\"input_ids\": [";
    for (int i = 0; i < 20 + line; ++i) f << (i ? ", " : "") << 48 + (line * 7 + i * 3) % 10;
    f << "]}\n";
  }
  return {prose, digits};
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

TEST(RoutingReport, ProcessesReportWhatOneProcessReports) {
  auto world = parallel::testing::World();
  const RunConfig run = SmallRun();
  RoutingReportOptions o;
  o.data = Sources();
  o.num_resamples = 200;
  o.json_out = Temp("multi.json");
  std::ostringstream multi_log;
  const absl::Status multi = RunRoutingReport(run, o, world, multi_log);
  EXPECT_TRUE(multi.ok()) << multi;
  if (world->rank() != 0) return;
  o.json_out = Temp("single.json");
  std::ostringstream single_log;
  ASSERT_TRUE(RunRoutingReport(run, o, parallel::LocalCommunicator::Create(), single_log).ok());
  // The printed report after the model's start-up lines (up to the JSON
  // file's name), and every figure.
  const auto report = [](const std::string& log) {
    const size_t begin = log.find("routing-report:");
    return log.substr(begin, log.find("routing-report: every layer") - begin);
  };
  ASSERT_NE(multi_log.str().find("routing-report:"), std::string::npos) << multi_log.str();
  EXPECT_EQ(report(multi_log.str()), report(single_log.str()));
  EXPECT_EQ(ReadJson(Temp("multi.json")), ReadJson(Temp("single.json")));
}

TEST(RoutingReport, FiguresHoldTogetherAndDigitsDrawTheirExperts) {
  auto world = parallel::LocalCommunicator::Create();
  const RunConfig run = SmallRun();
  RoutingReportOptions o;
  o.data = Sources();
  o.num_resamples = 300;
  o.json_out = Temp("figures.json");
  std::ostringstream log;
  ASSERT_TRUE(RunRoutingReport(run, o, world, log).ok());
  const nlohmann::json j = ReadJson(o.json_out);
  ASSERT_EQ(j["sources"].size(), 2u);
  EXPECT_EQ(j["sources"][0]["sequences"], 40);  // 64 x 40 bytes of prose
  EXPECT_EQ(j["sources"][1]["sequences"], 30);
  EXPECT_EQ(j["sources"][1]["tokens"], 30 * 20 + 29 * 30 / 2);
  int digit_experts = 0;
  for (const nlohmann::json& source : j["sources"]) {
    ASSERT_EQ(source["layers"].size(), 2u);
    for (const nlohmann::json& layer : source["layers"]) {
      double sum = 0, control_sum = 0;
      for (const nlohmann::json& x : layer["experts"]) {
        sum += x["share"].get<double>();
        control_sum += x["control_share"].get<double>();
        EXPECT_LE(x["low"].get<double>(), x["share"].get<double>() + 1e-12);
        EXPECT_GE(x["high"].get<double>(), x["share"].get<double>() - 1e-12);
        if (source["path"] == o.data[1] && x["above_other_sources"].get<bool>()) {
          ++digit_experts;
          EXPECT_GT(x["lift"].get<double>(), 1.0);
        }
      }
      EXPECT_NEAR(sum, 2.0, 1e-9);  // top-2: every token chose two experts
      EXPECT_NEAR(control_sum, 2.0, 1e-9);
    }
  }
  EXPECT_GE(digit_experts, 1) << log.str();
  EXPECT_NE(log.str().find("takes more than elsewhere"), std::string::npos) << log.str();
}

TEST(RoutingReport, SourcesAreReadAsDocumentedAndBadOnesNamed) {
  const std::string text = Temp("short.txt");
  std::ofstream(text) << "abcdefghij";  // 10 bytes in pieces of 4: 4, 4, 2
  auto seqs = ReadReportSource(text, 4, 256, 100);
  ASSERT_TRUE(seqs.ok()) << seqs.status();
  ASSERT_EQ(seqs->size(), 3u);
  EXPECT_EQ((*seqs)[2], (std::vector<int64_t>{'i', 'j'}));
  EXPECT_EQ(ReadReportSource(text, 4, 256, 2)->size(), 2u);
  const std::string jsonl = Temp("cut.jsonl");
  std::ofstream(jsonl) << "{\"input_ids\": [1, 2, 3, 4, 5]}\n\n{\"input_ids\": [7]}\n";
  auto cut = ReadReportSource(jsonl, 3, 10, 100);
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(*cut, (std::vector<std::vector<int64_t>>{{1, 2, 3}, {7}}));
  EXPECT_NE(ReadReportSource(jsonl, 3, 5, 100)
                .status()
                .message()
                .find("cut.jsonl:1: \"input_ids\" holds 5, outside [0, 5)"),
            std::string::npos);
  EXPECT_NE(ReadReportSource(text, 4, 100, 100).status().message().find("byte tokenizer"),
            std::string::npos);
  EXPECT_EQ(ReadReportSource("/nonexistent.jsonl", 4, 256, 1).status().message(),
            "--data /nonexistent.jsonl: cannot open");
  RoutingReportOptions none;
  EXPECT_NE(RunRoutingReport(SmallRun(), none, parallel::LocalCommunicator::Create(), std::cout)
                .message()
                .find("routing-report needs --data FILE"),
            std::string::npos);
}

}  // namespace
}  // namespace moefit::launch
