// Launch and indexing helpers shared by the CUDA kernels in this directory.
#pragma once

#include <ATen/cuda/detail/IntegerDivider.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../bn_act_elementwise.h"

namespace fxfuse::cuda {

// Threads per block of the elementwise kernels: a power of two (block_sum relies on it).
constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements.
inline unsigned int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 1 << 20)));
}

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

// Sum of v over the kThreads threads of the block, in a fixed order (deterministic);
// the result is valid in thread 0. Every thread of the block must call it.
template <typename A>
__device__ inline A block_sum(A v, A* shared /* kThreads elements */) {
  __syncthreads();  // a previous block_sum's readers are done with `shared`
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  return shared[0];
}

}  // namespace fxfuse::cuda
