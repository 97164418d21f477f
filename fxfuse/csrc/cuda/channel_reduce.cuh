// Per-channel sums of two per-element terms over a dense NCHW or channels_last tensor:
// the reduction of bn_act_backward (sum(g), sum(g * (x - mean))) and of bn_stats
// (sum(x), then sum((x - mean)^2)).
//
// Every SM works: the grid is (channel tiles) x (splits), each block summing one split
// (a contiguous range of the channel's M = N * H * W elements) of its channels into a
// partial, and the partials are then summed per channel in a fixed order (deterministic:
// the same bits on every run of the same shape). Loads are coalesced in both layouts:
//  * NCHW: one channel per block, the threads along the split's range, whose elements
//    are runs of H * W consecutive addresses;
//  * channels_last: a block is kTile channels (one warp: 32 consecutive addresses of
//    one pixel) x kRows pixels, each thread keeping its channel.
// Arithmetic in A (float for half / bfloat16 / float, double for double); offsets in I
// (unsigned 32-bit where the tensor allows, int64_t otherwise).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "launch.cuh"

namespace fxfuse::cuda {

constexpr int kTile = 32;  // channels_last: channels per block (blockDim.x)
constexpr int kRows = 8;   // channels_last: pixels in flight per block (blockDim.y)

// Terms: a functor `void operator()(I offset, A& a, A& b) const` that adds the element's
// two terms, after `setup(I channel)` has loaded the channel's values (once per thread).
// The caller picks I: unsigned int where cuda::fits_32bit(numel), int64_t otherwise.
template <typename A, typename I, typename Terms>
__global__ void channel_sums_nchw_kernel(
    Terms terms, elementwise::Layout layout, I M, I chunk, at::cuda::detail::IntDivider<I> hw_div,
    A* __restrict__ partial) {
  __shared__ A shared[kThreads];
  const I C = static_cast<I>(layout.C), HW = static_cast<I>(layout.HW);
  const I c = blockIdx.x;
  const I begin = static_cast<I>(blockIdx.y) * chunk;
  const I end = M - begin < chunk ? M : begin + chunk;
  Terms t = terms;
  t.setup(c);
  A a = A(0), b = A(0);
  for (I j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const auto nq = hw_div.divmod(j);
    t((nq.div * C + c) * HW + nq.mod, a, b);
  }
  a = block_sum(a, shared);
  b = block_sum(b, shared);
  if (threadIdx.x == 0) {
    partial[(static_cast<int64_t>(blockIdx.y) * 2) * layout.C + c] = a;
    partial[(static_cast<int64_t>(blockIdx.y) * 2 + 1) * layout.C + c] = b;
  }
}

template <typename A, typename I, typename Terms>
__global__ void channel_sums_nhwc_kernel(
    Terms terms, elementwise::Layout layout, I M, I chunk, A* __restrict__ partial) {
  __shared__ A shared_a[kRows][kTile + 1];
  __shared__ A shared_b[kRows][kTile + 1];
  const I C = static_cast<I>(layout.C);
  const I c = static_cast<I>(blockIdx.x) * kTile + threadIdx.x;
  const I begin = static_cast<I>(blockIdx.y) * chunk;
  const I end = M - begin < chunk ? M : begin + chunk;
  A a = A(0), b = A(0);
  if (c < C) {
    Terms t = terms;
    t.setup(c);
    for (I r = begin + threadIdx.y; r < end; r += kRows) t(r * C + c, a, b);
  }
  shared_a[threadIdx.y][threadIdx.x] = a;
  shared_b[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int k = 1; k < kRows; ++k) {
      a += shared_a[k][threadIdx.x];
      b += shared_b[k][threadIdx.x];
    }
    partial[(static_cast<int64_t>(blockIdx.y) * 2) * layout.C + c] = a;
    partial[(static_cast<int64_t>(blockIdx.y) * 2 + 1) * layout.C + c] = b;
  }
}

// The per-channel sums (a, b), each a C-vector of dtype `acc`, on the current stream.
template <typename A, typename I, typename Terms>
std::pair<at::Tensor, at::Tensor> channel_sums(
    const Terms& terms, const elementwise::Layout& L, at::TensorOptions acc) {
  const int64_t M = L.N * L.HW;
  const int64_t tiles = L.channels_last ? (L.C + kTile - 1) / kTile : L.C;
  const int64_t per_thread_min = 4;  // elements a thread sums at least, when splitting
  const int64_t threads_per_row = L.channels_last ? kRows : kThreads;
  // About four blocks per SM in all, no split shorter than per_thread_min per thread.
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  const int64_t target = 4 * static_cast<int64_t>(std::max(sms, 1));
  int64_t splits = std::max<int64_t>(1, (target + tiles - 1) / tiles);
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, M / (threads_per_row * per_thread_min)));
  splits = std::min<int64_t>(splits, 65535);
  const int64_t chunk = (M + splits - 1) / splits;
  splits = (M + chunk - 1) / chunk;
  at::Tensor partial = at::empty({splits, 2, L.C}, acc);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned int>(tiles), static_cast<unsigned int>(splits));
  if (L.channels_last) {
    channel_sums_nhwc_kernel<A, I, Terms><<<grid, dim3(kTile, kRows), 0, stream>>>(
        terms, L, static_cast<I>(M), static_cast<I>(chunk), partial.mutable_data_ptr<A>());
  } else {
    channel_sums_nchw_kernel<A, I, Terms><<<grid, kThreads, 0, stream>>>(
        terms, L, static_cast<I>(M), static_cast<I>(chunk),
        at::cuda::detail::IntDivider<I>(static_cast<I>(L.HW)), partial.mutable_data_ptr<A>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The partials of each channel, summed over the splits (ATen's reduction: deterministic).
  // Two separate tensors: the ops return them, and outputs must not share storage.
  return {partial.select(1, 0).sum(0), partial.select(1, 1).sum(0)};
}

}  // namespace fxfuse::cuda
