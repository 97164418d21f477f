// CUDA kernel of fxfuse::bn_stats: per-channel mean and variance in two passes over the
// input (sum(x), then sum((x - mean)^2)), each a split, coalesced, deterministic
// per-channel reduction (channel_reduce.cuh), accumulated in float for half / bfloat16
// with no float copy of the input. Contiguous NCHW and channels_last inputs; other layouts
// and empty inputs take the generic path (ATen's batch_norm_update_stats).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../bn_act.h"
#include "../bn_act_elementwise.h"
#include "../bn_act_host_setup.h"
#include "../checks.h"
#include "channel_reduce.cuh"

namespace fxfuse {
namespace {

namespace ew = elementwise;

// sum(x) in the first slot, nothing in the second.
template <typename T, typename A, typename I>
struct SumTerms {
  const T* x;
  __device__ void setup(I) {}
  __device__ void operator()(I o, A& a, A&) const { a += static_cast<A>(x[o]); }
};

// sum((x - mean)^2) in the first slot.
template <typename T, typename A, typename I>
struct SquareTerms {
  const T* x;
  const A* mean_of;
  A mean;
  __device__ void setup(I c) { mean = mean_of[c]; }
  __device__ void operator()(I o, A& a, A&) const { a += ew::centered_square<T, A>(x[o], mean); }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_cuda(const at::Tensor& input) {
  checks::bn_input(input, "bn_stats");
  const auto layout = ew::layout_of(input);
  if (!layout || input.numel() == 0) return bn_stats_generic(input);
  const c10::cuda::CUDAGuard guard(input.device());
  const ew::Layout L = layout->first;
  const int64_t M = L.N * L.HW;
  const auto acc = input.options().dtype(stats_dtype(input.scalar_type()));
  std::tuple<at::Tensor, at::Tensor, at::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "fxfuse::bn_stats_cuda", [&] {
        using A = at::opmath_type<scalar_t>;
        const scalar_t* x = input.const_data_ptr<scalar_t>();
        auto run = [&](auto index) {
          using I = decltype(index);
          at::Tensor mean = cuda::channel_sums<A, I>(SumTerms<scalar_t, A, I>{x}, L, acc).first /
              static_cast<double>(M);
          at::Tensor sum_sq = cuda::channel_sums<A, I>(
              SquareTerms<scalar_t, A, I>{x, mean.const_data_ptr<A>(), A(0)}, L, acc).first;
          result = ew::stats_from_squares(mean, sum_sq, M);
        };
        if (cuda::fits_32bit(input.numel())) {
          run(static_cast<unsigned int>(0));
        } else {
          run(static_cast<int64_t>(0));
        }
      });
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("bn_stats", &bn_stats_cuda);
}

}  // namespace fxfuse
