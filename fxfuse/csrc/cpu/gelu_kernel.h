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

}  // namespace fxfuse::cpu
