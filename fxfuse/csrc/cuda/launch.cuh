// Launch and indexing helpers shared by the CUDA kernels in this directory.
#pragma once

#include <ATen/cuda/detail/IntegerDivider.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>

#include "../bn_act_device.h"
#include "../bn_act_elementwise.h"

namespace fxfuse::cuda {

// Threads per block: a power of two (channel_reduce.cuh's block_merge relies on it).
constexpr int kThreads = 256;

// Whether every flat offset of an n-element tensor takes the 32-bit index path: unsigned
// arithmetic and ATen's multiply-shift divider, which requires dividends <= INT32_MAX.
// Larger tensors take int64_t with plain division.
inline bool fits_32bit(int64_t n) { return n <= std::numeric_limits<int32_t>::max(); }

// The channel of flat offset i in a dense NCHW or channels_last layout, in index type I.
template <typename I>
struct ChannelOf {
  at::cuda::detail::IntDivider<I> hw, c;
  bool channels_last;

  explicit ChannelOf(const elementwise::Layout& L)
      : hw(static_cast<I>(std::max<int64_t>(L.HW, 1))),
        c(static_cast<I>(std::max<int64_t>(L.C, 1))),
        channels_last(L.channels_last) {}

  __device__ __forceinline__ I operator()(I i) const {
    return c.mod(channels_last ? i : hw.div(i));
  }
};

// The elementwise kernels' walk (bn_act_device.h): units of V elements (1 for
// Walk::Scalar), about kUnitsPerThread per thread in a grid-stride loop.
constexpr int64_t kUnitsPerThread = 4;

// The first channel of unit u, in index type I.
template <typename I>
struct UnitChannel {
  ChannelOf<I> of;
  I times;

  __device__ __forceinline__ I operator()(I u) const { return of(u) * times; }
};

// Plane: V elements of one channel per unit, so H * W / V units per plane; Pixel: V
// consecutive channels per unit, C / V units per pixel.
template <typename I>
inline UnitChannel<I> unit_channel(const elementwise::Layout& L, elementwise::Walk w, int V) {
  elementwise::Layout u = L;
  if (w == elementwise::Walk::Plane) u.HW = L.HW / V;
  if (w == elementwise::Walk::Pixel) u.C = L.C / V;
  return {ChannelOf<I>(u), static_cast<I>(w == elementwise::Walk::Pixel ? V : 1)};
}

// Blocks for the walk over `units`. With the Pixel walk, a multiple of the C / V units of a
// pixel over gcd(C / V, kThreads): the grid's stride is then a multiple of C / V, each
// thread meets the same channels at every step and computes their coefficients once.
inline unsigned int walk_blocks(int64_t units, const elementwise::Layout& L, elementwise::Walk w, int V) {
  const int64_t per_block = kThreads * kUnitsPerThread;
  int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((units + per_block - 1) / per_block, 1 << 20));
  if (w == elementwise::Walk::Pixel) {
    const int64_t period = L.C / V;
    const int64_t m = period / std::gcd(period, static_cast<int64_t>(kThreads));
    blocks = (blocks + m - 1) / m * m;
  }
  return static_cast<unsigned int>(blocks);
}

}  // namespace fxfuse::cuda
