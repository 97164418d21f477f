// Raw-pointer interface between the CPU gelu / gelu_backward entry points
// (gelu_kernel.cpp) and the vectorized kernel bodies (gelu_kernel_impl.h), which
// are compiled once per CPU capability, like the bn_act kernels (capability.h):
//   DEFAULT  gelu_kernel.cpp       baseline ISA, generic at::vec::Vectorized
//   AVX2     gelu_kernel_avx2.cpp  #pragma GCC target("avx2,fma") and CPU_CAPABILITY_AVX2
//
// The kernels see a dense tensor as a flat array of n elements (any memory
// format works, as long as input, grad and output share their strides).
//
// Declarations only: the AVX2 translation unit includes this header before it
// switches the target ISA.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "capability.h"

namespace fxfuse::cpu {

template <typename T>
struct GeluKernelTable {
  // out[i] = gelu(x[i]), erf form or (tanh) the tanh approximation.
  void (*forward)(const T* x, T* out, int64_t n, bool tanh);
  // grad_input[i] = dy[i] * gelu'(x[i]).
  void (*backward)(const T* dy, const T* x, T* grad_input, int64_t n, bool tanh);
};

namespace DEFAULT {
template <typename T>
const GeluKernelTable<T>& gelu_kernels();
}  // namespace DEFAULT

#if FXFUSE_HAVE_AVX2_KERNELS
namespace AVX2 {
template <typename T>
const GeluKernelTable<T>& gelu_kernels();
}  // namespace AVX2
#endif

// oneDNN's float32 erf-GELU, which eager runs for contiguous input, and ATen's own
// kernel, which eager runs otherwise, disagree on overflow on some ISAs: oneDNN's
// AVX-512 kernel returns NaN for +inf and +inf for x >= FLT_MAX / 2, where ATen's
// returns +inf and x (its AVX2 kernel agrees with ATen's). Both agree elsewhere, up to
// rounding, and every output that can differ is non-finite or >= kGeluOverflowCheck in
// magnitude in both. The two fix-ups below give such outputs the value eager has for
// the layout at hand; they scan the output and touch nothing else.
constexpr float kGeluOverflowCheck = 1e38f;

// `out` holds oneDNN's GELU of the float32 array `x` (n elements), for a layout where
// eager runs ATen's kernel: recompute the outputs that can differ with ATen's formula.
void gelu_overflow_as_aten(const float* x, float* out, int64_t n);

// `out` (contiguous float32) holds the erf-GELU of some z computed with ATen's formula
// (so an output that can differ equals its z, or is NaN): give those outputs the value
// oneDNN's GELU, which eager runs for contiguous input, has for them.
void gelu_overflow_as_onednn(const at::Tensor& out);

// Whether ATen runs oneDNN's GELU for contiguous float32 input (oneDNN built and enabled).
bool onednn_runs_gelu();

}  // namespace fxfuse::cpu
