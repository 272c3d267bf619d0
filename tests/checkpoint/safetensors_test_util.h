// Builders of safetensors byte images for tests and the fuzz driver.
//
// The corrupt-file tests need files the writer refuses to produce, so they
// assemble the bytes themselves: an 8-byte length, header text, data. These
// helpers keep that arithmetic in one place and stay free of gtest and torch,
// so the fuzz driver can use them for its seed corpus.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace moefit::checkpoint::testing {

// A file image: little-endian length of `header`, `header` (padded with spaces
// to a multiple of 8 when `pad`), then `data`.
std::string SafetensorsBytes(std::string_view header, std::string_view data, bool pad = true);

// Same with an explicit (possibly lying) header length.
std::string SafetensorsBytesWithLength(uint64_t header_length, std::string_view header,
                                       std::string_view data);

// Writes `bytes` to `dir/name` (replacing it) and returns the path.
std::filesystem::path WriteBytes(const std::filesystem::path& dir, std::string_view name,
                                 std::string_view bytes);

// Deterministic pseudo-random bytes.
std::string PseudoRandomBytes(size_t num_bytes, uint64_t seed);

// Seed inputs for fuzzing: valid files of several dtypes and layouts, and one
// of each kind of corruption the parser must reject.
std::vector<std::string> FuzzSeeds();

}  // namespace moefit::checkpoint::testing
