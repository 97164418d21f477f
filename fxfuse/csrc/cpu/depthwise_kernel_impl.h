// Vectorized, multi-threaded CPU kernel body for the weight (and bias) gradient of a 2-D
// depthwise convolution over channels_last tensors. Compiled once per CPU capability: include
// this header from exactly one translation unit per capability, with CPU_CAPABILITY defined
// to its name (DEFAULT or AVX2) and, for AVX2, CPU_CAPABILITY_AVX2 and a matching target ISA.
//
// Why it exists: oneDNN, which ATen runs for a float32 depthwise convolution, computes the
// input gradient fast but the weight gradient 5-50x slower than the input gradient of the
// same FLOPs (ConvNeXt-T's 7x7 depthwise convolutions: ~11 ms against ~1 ms per call on two
// threads), about a fifth of ConvNeXt-T's CPU training step in a profile.
//
// How: the output rows (n, oh) are cut into at most kRanges ranges of consecutive rows, one
// work item each, summed into a C x KH x KW buffer of their own. Within a range, for each
// output row, each kernel row kh (input row ih) and each block of channels (contiguous in
// channels_last memory: two or four vectors, then one, then scalar lanes), the KW products of
// every output pixel of the row are summed into registers (the kernel width is a compile-time
// constant for 3, 5 and 7), which are then added to the buffer: partial sums of one output
// row each, so the float32 rounding error grows with the number of rows, not of pixels. All
// channels of a row are done while its input rows are in cache, so the tensors stream from
// memory once. The buffers are added in order at the end: the result is the same for any
// thread count.
#pragma once

#ifndef CPU_CAPABILITY
#error "depthwise_kernel_impl.h must be included with CPU_CAPABILITY defined"
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "depthwise_kernel.h"
#include "fma_rounding.h"

namespace fxfuse::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// The output rows (n, oh) are cut into at most kRanges ranges of consecutive rows, each
// summed into a buffer of its own by one thread; the buffers are added in order at the end.
// Fixed, so that the result does not depend on the thread count (which it caps at 16).
constexpr int64_t kRanges = 16;

// The output columns [lo, hi) whose KW taps all fall inside the input row.
struct Interior {
  int64_t lo, hi;
};

inline Interior interior(const DepthwiseGeometry& g) {
  const int64_t lo = std::min(g.OW, (g.pad_w + g.stride_w - 1) / g.stride_w);
  const int64_t last = g.W - 1 + g.pad_w - (g.KW - 1) * g.dilation_w;  // ow * sw <= last
  const int64_t hi = last < 0 ? 0 : std::min(g.OW, last / g.stride_w + 1);
  return {lo, std::max(lo, hi)};
}

// Adds the products of output pixel ow to the registers a[kw][v]; kCheck: skip taps outside.
template <typename T, int V, int KW, bool kCheck>
inline void pixel(
    const T* x, const T* gy, int64_t ow, Vectorized<T> (&a)[KW][V], const DepthwiseGeometry& g) {
  using Vec = Vectorized<T>;
  constexpr int64_t L = Vec::size();
  Vec gv[V];
  for (int v = 0; v < V; ++v) gv[v] = Vec::loadu(gy + ow * g.C + v * L);
  const int64_t iw0 = ow * g.stride_w - g.pad_w;
  for (int kw = 0; kw < KW; ++kw) {
    const int64_t iw = iw0 + kw * g.dilation_w;
    if (kCheck && (iw < 0 || iw >= g.W)) continue;
    const T* xp = x + iw * g.C;
    for (int v = 0; v < V; ++v) a[kw][v] = madd(Vec::loadu(xp + v * L), gv[v], a[kw][v]);
  }
}

// One (output row, kernel row) of a block of V vectors, kernel width KW known at compile
// time: acc[kw * C + lane] += the row's products for tap kw.
template <typename T, int V, int KW>
void row_vec(const T* x, const T* gy, T* acc, const DepthwiseGeometry& g, Interior in) {
  // acc[kw * g.C + c]: the taps of one kernel row, channel-contiguous
  using Vec = Vectorized<T>;
  constexpr int64_t L = Vec::size();
  Vec a[KW][V];
  for (int kw = 0; kw < KW; ++kw) {
    for (int v = 0; v < V; ++v) a[kw][v] = Vec(T(0));
  }
  int64_t ow = 0;
  for (; ow < in.lo; ++ow) pixel<T, V, KW, true>(x, gy, ow, a, g);
  for (; ow < in.hi; ++ow) pixel<T, V, KW, false>(x, gy, ow, a, g);
  for (; ow < g.OW; ++ow) pixel<T, V, KW, true>(x, gy, ow, a, g);
  for (int kw = 0; kw < KW; ++kw) {
    for (int v = 0; v < V; ++v) {
      T* p = acc + kw * g.C + v * L;
      (Vec::loadu(p) + a[kw][v]).store(p);
    }
  }
}

// The same for any kernel width and any block width (width lanes from x and gy), one lane
// at a time: the scalar lanes after the last vector, and kernel widths other than 3, 5, 7.
// a: scratch for the row's sums, KW x width elements.
template <typename T>
void row_scalar(const T* x, const T* gy, T* acc, int64_t width, const DepthwiseGeometry& g, T* a) {
  std::fill_n(a, g.KW * width, T(0));
  for (int64_t ow = 0; ow < g.OW; ++ow) {
    const int64_t iw0 = ow * g.stride_w - g.pad_w;
    for (int64_t kw = 0; kw < g.KW; ++kw) {
      const int64_t iw = iw0 + kw * g.dilation_w;
      if (iw < 0 || iw >= g.W) continue;
      for (int64_t c = 0; c < width; ++c) {
        a[kw * width + c] = madd(x[iw * g.C + c], gy[ow * g.C + c], a[kw * width + c]);
      }
    }
  }
  for (int64_t kw = 0; kw < g.KW; ++kw) {
    for (int64_t c = 0; c < width; ++c) acc[kw * g.C + c] += a[kw * width + c];
  }
}

// One (output row, kernel row) over all channels: blocks of V vectors (as many as the
// registers hold for this kernel width), then single vectors, then scalar lanes.
template <typename T, int V, int KW>
void row_channels(
    const T* x, const T* gy, T* acc, const DepthwiseGeometry& g, Interior in, T* scratch) {
  constexpr int64_t L = Vectorized<T>::size();
  int64_t c = 0;
  for (; c + V * L <= g.C; c += V * L) row_vec<T, V, KW>(x + c, gy + c, acc + c, g, in);
  for (; c + L <= g.C; c += L) row_vec<T, 1, KW>(x + c, gy + c, acc + c, g, in);
  if (c < g.C) row_scalar<T>(x + c, gy + c, acc + c, g.C - c, g, scratch);
}

// scratch: KW x C elements for row_scalar.
template <typename T>
void accumulate_row(
    const T* x, const T* gy, T* acc, const DepthwiseGeometry& g, Interior in, T* scratch) {
  switch (g.KW) {
    case 3: return row_channels<T, 4, 3>(x, gy, acc, g, in, scratch);
    case 5: return row_channels<T, 2, 5>(x, gy, acc, g, in, scratch);
    case 7: return row_channels<T, 2, 7>(x, gy, acc, g, in, scratch);
    default: return row_scalar<T>(x, gy, acc, g.C, g, scratch);
  }
}

// acc[c] += sum over ow of gy[ow][c], for every channel.
template <typename T>
void bias_row(const T* gy, T* acc, const DepthwiseGeometry& g) {
  const int64_t width = g.C;
  using Vec = Vectorized<T>;
  constexpr int64_t L = Vec::size();
  int64_t c = 0;
  for (; c + L <= width; c += L) {
    Vec s(T(0));
    for (int64_t ow = 0; ow < g.OW; ++ow) s = s + Vec::loadu(gy + ow * g.C + c);
    (Vec::loadu(acc + c) + s).store(acc + c);
  }
  for (; c < width; ++c) {
    T s = T(0);
    for (int64_t ow = 0; ow < g.OW; ++ow) s += gy[ow * g.C + c];
    acc[c] += s;
  }
}

template <typename T>
void weight_grad_kernel(
    const T* x, const T* gy, T* grad_weight, T* grad_bias, const DepthwiseGeometry& g) {
  constexpr int64_t L = Vectorized<T>::size();
  const int64_t K = g.KH * g.KW;
  const int64_t rows = g.N * g.OH;
  const int64_t ranges = std::min<int64_t>(rows, kRanges);
  // partial[r][k][c] and partial_bias[r][c]: the sums over the output rows of range r.
  std::vector<T> partial(ranges * K * g.C, T(0)), partial_bias(grad_bias ? ranges * g.C : 0, T(0));
  const Interior in = interior(g);

  at::parallel_for(0, ranges, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scratch(g.KW * g.C);
    for (int64_t r = begin; r < end; ++r) {
      T* acc = partial.data() + r * K * g.C;
      for (int64_t row = r * rows / ranges; row < (r + 1) * rows / ranges; ++row) {
        const int64_t n = row / g.OH, oh = row % g.OH;
        const T* gy_row = gy + row * g.OW * g.C;
        for (int64_t kh = 0; kh < g.KH; ++kh) {
          const int64_t ih = oh * g.stride_h - g.pad_h + kh * g.dilation_h;
          if (ih < 0 || ih >= g.H) continue;
          const T* x_row = x + ((n * g.H + ih) * g.W) * g.C;
          accumulate_row<T>(x_row, gy_row, acc + kh * g.KW * g.C, g, in, scratch.data());
        }
        if (grad_bias) bias_row<T>(gy_row, partial_bias.data() + r * g.C, g);
      }
    }
  });

  // Add the ranges in order into range 0 (vectorized over k and c), then transpose.
  using Vec = Vectorized<T>;
  auto add_ranges = [&](T* sums, int64_t stride, int64_t count) {
    at::parallel_for(0, count, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t r = 1; r < ranges; ++r) {
        const T* p = sums + r * stride;
        int64_t i = begin;
        for (; i + L <= end; i += L) (Vec::loadu(sums + i) + Vec::loadu(p + i)).store(sums + i);
        for (; i < end; ++i) sums[i] += p[i];
      }
    });
  };
  add_ranges(partial.data(), K * g.C, K * g.C);
  for (int64_t c = 0; c < g.C; ++c) {
    for (int64_t k = 0; k < K; ++k) grad_weight[c * K + k] = partial[k * g.C + c];
  }
  if (grad_bias) {
    add_ranges(partial_bias.data(), g.C, g.C);
    std::copy_n(partial_bias.data(), g.C, grad_bias);
  }
}

}  // namespace

template <typename T>
const DepthwiseKernelTable<T>& depthwise_kernels() {
  static const DepthwiseKernelTable<T> table{&weight_grad_kernel<T>};
  return table;
}

template const DepthwiseKernelTable<float>& depthwise_kernels<float>();
template const DepthwiseKernelTable<double>& depthwise_kernels<double>();

}  // namespace fxfuse::cpu::CPU_CAPABILITY
