// Raw-pointer interface between the CPU operator entry points
// (bn_act_kernel.cpp) and the vectorized kernel bodies (bn_act_kernel_impl.h),
// which are compiled once per CPU capability:
//   DEFAULT  bn_act_kernel.cpp       baseline ISA, generic at::vec::Vectorized
//   AVX2     bn_act_kernel_avx2.cpp  #pragma GCC target("avx2,fma") and
//                                    CPU_CAPABILITY_AVX2 (x86-64 GCC/Clang only)
// The entry points pick a table at run time (cpu::use_avx2_kernels, capability.h).
//
// Declarations only: this header must stay free of inline code, because the
// AVX2 translation unit includes it before switching the target ISA.
#pragma once

#include <cstdint>

#include "../bn_act.h"
#include "capability.h"

namespace fxfuse::cpu {

// A dense 4-D tensor seen either as N*C planes of HW contiguous elements
// (nhwc == false: contiguous NCHW) or as N*HW rows of C contiguous elements
// (nhwc == true: channels_last, or NCHW with H*W == 1).
struct Geometry {
  int64_t N;
  int64_t C;
  int64_t HW;
  bool nhwc;
};

// Per-channel coefficients, arrays of length C in dtype T. The pre-activation is
// computed as ATen's batch_norm computes it, z = x * alpha + beta, with
// alpha = invstd * weight and beta = bias - mean * alpha (bias 0 when absent);
// grad_input is
//   batch_stats: ((g - k1) - ((x - mean) * invstd) * k2) * alpha
//   otherwise:   g * alpha
// with k1 = sum_g / M and k2 = sum_gx / M (only needed, and only set, for batch_stats).
template <typename T>
struct Coeffs {
  const T* mean;
  const T* alpha;
  const T* beta;
  const T* invstd;
  const T* k1;
  const T* k2;
};

template <typename T>
struct KernelTable {
  // beta = bias - mean * alpha (bias may be null), rounded as ATen's build of this
  // capability rounds it.
  void (*shift)(int64_t C, const T* mean, const T* alpha, const T* bias, T* beta);
  // out = act(z).
  void (*forward)(
      const Geometry& g, const T* x, const Coeffs<T>& cf, Act act, T act_param, T* out);
  // Per-channel sums, in double, of g = dy * act'(z) and of g * (x - mean); g itself is
  // written to g_out (dy's layout; it may be dy) unless g_out is null.
  void (*backward_reduce)(
      const Geometry& g, const T* dy, const T* x, const Coeffs<T>& cf, Act act, T act_param,
      double* sum_g, double* sum_gxm, T* g_out);
  // grad_input from dy and x, recomputing g.
  void (*backward_input)(
      const Geometry& g, const T* dy, const T* x, const Coeffs<T>& cf, bool batch_stats,
      Act act, T act_param, T* grad_input);
};

namespace DEFAULT {
template <typename T>
const KernelTable<T>& kernels();
}  // namespace DEFAULT

#if FXFUSE_HAVE_AVX2_KERNELS
namespace AVX2 {
template <typename T>
const KernelTable<T>& kernels();
}  // namespace AVX2
#endif

}  // namespace fxfuse::cpu
