// The mapping table files compiled into the library (internal).
//
// checkpoint/mappings/embed_tables.cmake generates the definition at build time
// from the table files listed in checkpoint/CMakeLists.txt, so a binary carries
// its tables and never looks for data files at run time. mapping_table.cc parses
// them; nothing else should need this.
#pragma once

#include <span>
#include <string_view>

namespace moefit::checkpoint::internal {

struct EmbeddedTable {
  std::string_view family;  // "qwen3_moe"
  std::string_view file;    // "checkpoint/mappings/qwen3_moe.textproto", for messages
  std::string_view text;    // the file's contents
};

// Every table, in the order of the list in checkpoint/CMakeLists.txt.
std::span<const EmbeddedTable> EmbeddedTables();

}  // namespace moefit::checkpoint::internal
