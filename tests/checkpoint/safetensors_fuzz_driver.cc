// Plain driver for safetensors_fuzz.cc: runs LLVMFuzzerTestOneInput without
// libFuzzer, so the fuzz target runs under ctest on every build (with ASan and
// UBSan where the compiler has them) even where clang is not installed.
//
// It replays the seed corpus (safetensors_test_util.h), then a fixed number of
// mutants made by a seeded PRNG, so a failure reproduces exactly. The mutations
// aim at what the parser checks: bit flips and byte edits, numbers in the
// header replaced by boundary values, dtype and key names swapped, the length
// prefix rewritten, truncation, splicing.
//
// Usage: safetensors_fuzz_driver [--iterations N] [--seed S] [--write-seeds DIR] [FILE...]
//   FILEs (e.g. crash inputs saved by libFuzzer) are run after the seeds.
//   --write-seeds DIR writes the seed corpus for libFuzzer and exits.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/safetensors.h"
#include "tests/checkpoint/safetensors_test_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

constexpr std::string_view kNumbers[] = {"0",
                                         "1",
                                         "2",
                                         "3",
                                         "4",
                                         "7",
                                         "8",
                                         "-1",
                                         "1.5",
                                         "1e3",
                                         "255",
                                         "256",
                                         "65536",
                                         "4294967296",
                                         "9223372036854775807",
                                         "9223372036854775808",
                                         "18446744073709551615",
                                         "18446744073709551616",
                                         "100000000",
                                         "100000001"};

constexpr std::string_view kTokens[] = {"BOOL",
                                        "U8",
                                        "I8",
                                        "F16",
                                        "BF16",
                                        "F32",
                                        "F64",
                                        "C64",
                                        "F8_E4M3",
                                        "F8_E8M0",
                                        "F6_E2M3",
                                        "F4",
                                        "Q4",
                                        "\"dtype\"",
                                        "\"shape\"",
                                        "\"data_offsets\"",
                                        "\"__metadata__\"",
                                        "\"weight_map\"",
                                        "\"metadata\"",
                                        "\"total_size\"",
                                        "null",
                                        "[]",
                                        "{}",
                                        "[0,0]",
                                        "[",
                                        "]",
                                        "{",
                                        "}",
                                        ",",
                                        ":",
                                        "\"",
                                        "\\u0000",
                                        "\xff"};

// Runs one input from an exactly sized heap buffer, so ASan catches a read
// even one byte past its end. Returns whether the parser accepted it (the
// summary reports how many did: a mutator that only produces garbage the
// length check rejects would test little).
bool RunOne(const std::string& input) {
  std::vector<uint8_t> buffer(input.begin(), input.end());
  LLVMFuzzerTestOneInput(buffer.data(), buffer.size());
  return moefit::checkpoint::ParseHeader(std::as_bytes(std::span(buffer)), "driver").ok();
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  std::string Mutate(std::string input, const std::vector<std::string>& corpus) {
    const int num_mutations = 1 + static_cast<int>(Below(4));
    std::string header;
    std::string data;
    // Mostly mutate the header text and re-frame it with a correct length, so
    // mutants get past the length check into the JSON and layout checks;
    // otherwise mutate the raw bytes, length prefix included.
    if (Below(4) != 0 && Split(input, &header, &data)) {
      for (int mutation_idx = 0; mutation_idx < num_mutations; ++mutation_idx) {
        MutateOnce(Below(8) == 0 ? data : header, corpus);
      }
      return moefit::checkpoint::testing::SafetensorsBytes(header, data, /*pad=*/false);
    }
    for (int mutation_idx = 0; mutation_idx < num_mutations; ++mutation_idx) {
      MutateOnce(input, corpus);
    }
    return input;
  }

 private:
  uint64_t Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

  // Splits a well-framed file image into header text and data section.
  static bool Split(const std::string& input, std::string* header, std::string* data) {
    if (input.size() < 8) return false;
    uint64_t length = 0;
    for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<uint8_t>(input[i]);
    if (length > input.size() - 8) return false;
    *header = input.substr(8, length);
    *data = input.substr(8 + length);
    return true;
  }

  void MutateOnce(std::string& s, const std::vector<std::string>& corpus) {
    switch (Below(9)) {
      case 0:  // flip one bit
        if (!s.empty()) s[Below(s.size())] ^= static_cast<char>(1u << Below(8));
        break;
      case 1:  // overwrite one byte
        if (!s.empty()) s[Below(s.size())] = static_cast<char>(Below(256));
        break;
      case 2: {  // erase a range
        if (s.empty()) break;
        const size_t pos = Below(s.size());
        s.erase(pos, 1 + Below(std::min<size_t>(16, s.size() - pos)));
        break;
      }
      case 3: {  // duplicate a range somewhere else
        if (s.empty()) break;
        const size_t pos = Below(s.size());
        const std::string chunk = s.substr(pos, 1 + Below(32));
        s.insert(Below(s.size() + 1), chunk);
        break;
      }
      case 4:  // truncate
        s.resize(Below(s.size() + 1));
        break;
      case 5:  // replace a run of digits with a boundary number
        ReplaceDigitRun(s);
        break;
      case 6:  // insert or swap in a token
        InsertToken(s);
        break;
      case 7: {  // rewrite the length prefix near its value, or wildly
        if (s.size() < 8) break;
        uint64_t length = 0;
        for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<uint8_t>(s[i]);
        length = Below(4) == 0 ? rng_() : length + Below(17) - 8;
        for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((length >> (8 * i)) & 0xff);
        break;
      }
      case 8: {  // splice the tail of another corpus entry
        const std::string& other = corpus[Below(corpus.size())];
        s.resize(Below(s.size() + 1));
        s.append(other.substr(Below(other.size() + 1)));
        break;
      }
    }
  }

  void ReplaceDigitRun(std::string& s) {
    std::vector<size_t> starts;
    for (size_t pos = 8; pos < s.size(); ++pos) {
      const bool digit = s[pos] >= '0' && s[pos] <= '9';
      const bool previous_digit = s[pos - 1] >= '0' && s[pos - 1] <= '9';
      if (digit && !previous_digit) starts.push_back(pos);
    }
    if (starts.empty()) return;
    const size_t start = starts[Below(starts.size())];
    size_t end = start;
    while (end < s.size() && s[end] >= '0' && s[end] <= '9') ++end;
    const std::string_view number = kNumbers[Below(std::size(kNumbers))];
    s.replace(start, end - start, number);
  }

  void InsertToken(std::string& s) {
    const std::string_view token = kTokens[Below(std::size(kTokens))];
    const size_t pos = Below(s.size() + 1);
    if (Below(2) == 0 && pos < s.size()) {
      s.replace(pos, std::min<size_t>(token.size(), s.size() - pos), token);
    } else {
      s.insert(pos, token);
    }
  }

  std::mt19937_64 rng_;
};

std::string ReadFile(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path);
    std::exit(2);
  }
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

int main(int argc, char** argv) {
  long num_iterations = 5000;
  uint64_t seed = 20240611;
  std::vector<std::string> extra_inputs;
  for (int arg_idx = 1; arg_idx < argc; ++arg_idx) {
    const std::string_view arg = argv[arg_idx];
    if (arg == "--iterations" && arg_idx + 1 < argc) {
      num_iterations = std::strtol(argv[++arg_idx], nullptr, 10);
    } else if (arg == "--seed" && arg_idx + 1 < argc) {
      seed = std::strtoull(argv[++arg_idx], nullptr, 10);
    } else if (arg == "--write-seeds" && arg_idx + 1 < argc) {
      const std::filesystem::path dir = argv[++arg_idx];
      std::filesystem::create_directories(dir);
      const std::vector<std::string> seeds = moefit::checkpoint::testing::FuzzSeeds();
      for (size_t seed_idx = 0; seed_idx < seeds.size(); ++seed_idx) {
        moefit::checkpoint::testing::WriteBytes(dir, "seed-" + std::to_string(seed_idx),
                                                seeds[seed_idx]);
      }
      std::printf("wrote %zu seeds to %s\n", seeds.size(), dir.c_str());
      return 0;
    } else {
      extra_inputs.push_back(ReadFile(argv[arg_idx]));
    }
  }

  const std::vector<std::string> corpus = moefit::checkpoint::testing::FuzzSeeds();
  for (const std::string& input : corpus) RunOne(input);
  for (const std::string& input : extra_inputs) RunOne(input);
  Mutator mutator(seed);
  long num_accepted = 0;
  for (long iteration = 0; iteration < num_iterations; ++iteration) {
    const std::string& base = corpus[static_cast<size_t>(iteration) % corpus.size()];
    num_accepted += RunOne(mutator.Mutate(base, corpus)) ? 1 : 0;
  }
  std::printf("safetensors_fuzz_driver: %zu seeds, %zu files, %ld mutants (%ld valid files): ok\n",
              corpus.size(), extra_inputs.size(), num_iterations, num_accepted);
  return 0;
}
