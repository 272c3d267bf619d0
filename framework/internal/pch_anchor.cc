// Anchor translation unit for the moefit_pch object library: the precompiled
// torch header is built from this target and reused by all others.
namespace moefit::internal {
int PchAnchor() { return 0; }
}  // namespace moefit::internal
