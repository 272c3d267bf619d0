// Autocast of the dense layers' device for the life of a scope: how the
// trainer runs the forward pass and the loss under train.dense_dtype.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace moefit::framework {

// Matrix products in `dtype` on `device`'s type, the float32 parameters cast
// once per forward (LibTorch's cast cache) and their gradients float32; the
// autocast state found is restored at the end. Nothing when dtype is float32.
class DenseAutocast {
 public:
  DenseAutocast(c10::Device device, at::ScalarType dtype)
      : active_(dtype != at::kFloat), type_(device.type()) {
    if (!active_) return;
    previous_enabled_ = at::autocast::is_autocast_enabled(type_);
    previous_dtype_ = at::autocast::get_autocast_dtype(type_);
    at::autocast::set_autocast_enabled(type_, true);
    at::autocast::set_autocast_dtype(type_, dtype);
    at::autocast::increment_nesting();
  }
  ~DenseAutocast() {
    if (!active_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type_, previous_enabled_);
    at::autocast::set_autocast_dtype(type_, previous_dtype_);
  }
  DenseAutocast(const DenseAutocast&) = delete;
  DenseAutocast& operator=(const DenseAutocast&) = delete;

 private:
  const bool active_;
  const c10::DeviceType type_;
  bool previous_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kFloat;
};

}  // namespace moefit::framework
