// Precompiled header shared by every target that links LibTorch (see the top
// CMakeLists.txt). It holds only the heavy, stable torch headers; project
// headers are never listed here so that editing them does not rebuild the PCH.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/types.h>
