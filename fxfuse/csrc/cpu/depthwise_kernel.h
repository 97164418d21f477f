// Raw-pointer interface between the CPU depthwise-convolution backward entry point
// (depthwise_kernel.cpp) and the vectorized kernel body (depthwise_kernel_impl.h), which is
// compiled once per CPU capability, like the gelu and bn_act kernels (capability.h):
//   DEFAULT  depthwise_kernel.cpp       baseline ISA, generic at::vec::Vectorized
//   AVX2     depthwise_kernel_avx2.cpp  #pragma GCC target("avx2,fma") and CPU_CAPABILITY_AVX2
//
// Declarations only: the AVX2 translation unit includes this header before it switches the
// target ISA.
#pragma once

#include <cstdint>

#include "capability.h"

namespace fxfuse::cpu {

// A 2-D depthwise convolution (groups == in_channels == out_channels, one kernel plane per
// channel): input N x C x H x W, output N x C x OH x OW, kernel KH x KW.
struct DepthwiseGeometry {
  int64_t N, C, H, W, OH, OW, KH, KW;
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
};

template <typename T>
struct DepthwiseKernelTable {
  // grad_weight[c][kh][kw] = sum over n, oh, ow of
  //     input[n][oh*sh - ph + kh*dh][ow*sw - pw + kw*dw][c] * grad_out[n][oh][ow][c]
  // (terms outside the input are zero) and, when grad_bias is not null,
  // grad_bias[c] = sum over n, oh, ow of grad_out[n][oh][ow][c].
  // input and grad_out are channels_last (N, H, W, C in memory, dense); grad_weight is
  // C x KH x KW dense, grad_bias C. Multi-threaded; the result does not depend on the
  // number of threads.
  void (*weight_grad)(
      const T* input, const T* grad_out, T* grad_weight, T* grad_bias, const DepthwiseGeometry& g);
};

namespace DEFAULT {
template <typename T>
const DepthwiseKernelTable<T>& depthwise_kernels();
}  // namespace DEFAULT

#if FXFUSE_HAVE_AVX2_KERNELS
namespace AVX2 {
template <typename T>
const DepthwiseKernelTable<T>& depthwise_kernels();
}  // namespace AVX2
#endif

}  // namespace fxfuse::cpu
