// Natural ("human") ordering of tensor names.
//
// Checkpoints name experts and layers with decimal indices
// (`model.layers.3.mlp.experts.17.gate_proj.weight`). Plain string order puts
// `experts.10` before `experts.9`, which scrambles anything that walks tensors
// in order: packing experts into one [E, ...] tensor, listing a file, planning
// shards. NaturalLess compares runs of decimal digits by their numeric value
// and everything else byte by byte, so indices come out in counting order.
//
// It is a strict total order: names whose digit runs have equal values but
// different leading zeros (`e.01` vs `e.1`) are finally told apart by plain
// byte order, so it is safe for std::sort, std::map and std::set.
#pragma once

#include <string_view>

namespace moefit::checkpoint {

// True when `a` sorts before `b` in natural order.
bool NaturalLess(std::string_view a, std::string_view b);

// Comparator object for containers and algorithms:
// std::set<std::string, NaturalLessCompare>, std::ranges::sort(v, NaturalLessCompare{}).
struct NaturalLessCompare {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return NaturalLess(a, b); }
};

}  // namespace moefit::checkpoint
