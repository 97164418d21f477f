// The split per-channel reduction over a dense NCHW or channels_last tensor, first stage:
// bn_stats' Welford accumulation (mean, m2) and bn_act_backward's sums (sum(g),
// sum(g * (x - mean))), written as per-split partials [splits][2][C] that a finalize kernel
// merges per channel in split order (bn_act_device.h). No ATen op, one launch.
//
// Every SM works: the grid is (channel tiles) x (splits), each block reducing one split (a
// contiguous range of the channel's M = N * H * W elements) of its channels. Merges within a
// block run in a fixed order (deterministic: the same bits on every run of the same shape).
// Loads are coalesced in both layouts:
//  * NCHW: one channel per block, the threads along the split's range, whose elements
//    are runs of H * W consecutive addresses;
//  * channels_last: a block is kTile channels (one warp: 32 consecutive addresses of
//    one pixel) x kRows pixels, each thread keeping its channel.
// Arithmetic in A (float for half / bfloat16 / float, double for double); offsets in I
// (unsigned 32-bit where the tensor allows, int64_t otherwise).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "../bn_act_device.h"
#include "launch.cuh"

namespace fxfuse::cuda {

constexpr int kTile = 32;  // channels_last: channels per block (blockDim.x)
constexpr int kRows = 8;   // channels_last: pixels in flight per block (blockDim.y)

// Shared memory for n accumulators (which have default member initializers, which
// __shared__ variables may not have).
template <typename Acc, int n>
struct SharedAcc {
  alignas(Acc) unsigned char raw[sizeof(Acc) * n];
  __device__ Acc* get() { return reinterpret_cast<Acc*>(raw); }
};

// v merged over the kThreads threads of the block in a fixed tree order; valid in thread 0.
template <typename Acc>
__device__ inline Acc block_merge(Acc v, Acc* shared /* kThreads */) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) {
      Acc a = shared[threadIdx.x];
      a.merge(shared[threadIdx.x + s]);
      shared[threadIdx.x] = a;
    }
    __syncthreads();
  }
  return shared[0];
}

// Terms: `using Acc` (an accumulator with merge() and value(k), k = 0, 1), `void
// setup(I channel)` (loads the channel's values once per thread) and `void operator()(I
// offset, Acc&) const` (adds one element).
template <typename A, typename I, typename Terms>
__global__ void channel_partials_nchw_kernel(
    Terms terms, elementwise::Layout layout, I M, I chunk,
    at::cuda::detail::IntDivider<I> hw_div, A* __restrict__ partial) {
  using Acc = typename Terms::Acc;
  __shared__ SharedAcc<Acc, kThreads> shared;
  const I C = static_cast<I>(layout.C), HW = static_cast<I>(layout.HW);
  const I c = blockIdx.x;
  const I begin = static_cast<I>(blockIdx.y) * chunk;
  const I end = M - begin < chunk ? M : begin + chunk;
  Terms t = terms;
  t.setup(c);
  Acc acc;
  for (I j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const auto nq = hw_div.divmod(j);
    t((nq.div * C + c) * HW + nq.mod, acc);
  }
  acc = block_merge(acc, shared.get());
  if (threadIdx.x == 0) {
    partial[elementwise::Splits::at(blockIdx.y, 0, layout.C, c)] = acc.value(0);
    partial[elementwise::Splits::at(blockIdx.y, 1, layout.C, c)] = acc.value(1);
  }
}

template <typename A, typename I, typename Terms>
__global__ void channel_partials_nhwc_kernel(
    Terms terms, elementwise::Layout layout, I M, I chunk, A* __restrict__ partial) {
  using Acc = typename Terms::Acc;
  __shared__ SharedAcc<Acc, kRows * kTile> shared;
  Acc* rows = shared.get();
  const I C = static_cast<I>(layout.C);
  const I c = static_cast<I>(blockIdx.x) * kTile + threadIdx.x;
  const I begin = static_cast<I>(blockIdx.y) * chunk;
  const I end = M - begin < chunk ? M : begin + chunk;
  Acc acc;
  if (c < C) {
    Terms t = terms;
    t.setup(c);
    for (I r = begin + threadIdx.y; r < end; r += kRows) t(r * C + c, acc);
  }
  rows[threadIdx.y * kTile + threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int k = 1; k < kRows; ++k) acc.merge(rows[k * kTile + threadIdx.x]);
    partial[elementwise::Splits::at(blockIdx.y, 0, layout.C, c)] = acc.value(0);
    partial[elementwise::Splits::at(blockIdx.y, 1, layout.C, c)] = acc.value(1);
  }
}

// How the reduction splits each channel's M elements: about four blocks per SM in all, no
// split shorter than a few elements per thread.
inline elementwise::Splits device_splits(const elementwise::Layout& L) {
  const int64_t M = L.N * L.HW;
  const int64_t tiles = L.channels_last ? (L.C + kTile - 1) / kTile : L.C;
  const int64_t per_thread_min = 4;
  const int64_t threads_per_row = L.channels_last ? kRows : kThreads;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  const int64_t target = 4 * static_cast<int64_t>(std::max(sms, 1));
  int64_t splits = std::max<int64_t>(1, (target + tiles - 1) / tiles);
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, M / (threads_per_row * per_thread_min)));
  splits = std::min<int64_t>(splits, 65535);
  return elementwise::make_splits(M, splits);
}

// The partials [sp.count][2][C] of `terms` into `partial`, on the current stream.
template <typename A, typename I, typename Terms>
void channel_partials(
    const Terms& terms, const elementwise::Layout& L, const elementwise::Splits& sp, A* partial) {
  const int64_t tiles = L.channels_last ? (L.C + kTile - 1) / kTile : L.C;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned int>(tiles), static_cast<unsigned int>(sp.count));
  if (L.channels_last) {
    channel_partials_nhwc_kernel<A, I, Terms><<<grid, dim3(kTile, kRows), 0, stream>>>(
        terms, L, static_cast<I>(sp.M), static_cast<I>(sp.chunk), partial);
  } else {
    channel_partials_nchw_kernel<A, I, Terms><<<grid, kThreads, 0, stream>>>(
        terms, L, static_cast<I>(sp.M), static_cast<I>(sp.chunk),
        at::cuda::detail::IntDivider<I>(static_cast<I>(L.HW)), partial);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Blocks of kThreads for one thread per channel (the finalize kernels).
inline unsigned int channel_blocks(int64_t C) {
  return static_cast<unsigned int>((C + kThreads - 1) / kThreads);
}

}  // namespace fxfuse::cuda
