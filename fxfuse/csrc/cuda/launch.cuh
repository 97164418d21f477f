// Launch helpers shared by the CUDA kernels in this directory.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fxfuse::cuda {

// Threads per block: a power of two (block_sum below relies on it).
constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements.
inline unsigned int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 1 << 20)));
}

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
