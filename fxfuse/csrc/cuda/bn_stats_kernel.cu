// CUDA kernels of the batch statistics: fxfuse::bn_stats, the C++ entry point
// bn_stats_update (bn_act_kernels.h) and fxfuse::update_running_stats_.
//  * statistics: one pass of Welford accumulation per thread, merged within each block and
//    written per split (channel_reduce.cuh), accumulated in float for half / bfloat16 with
//    no float copy of the input; then a finalize, one thread per channel, that merges the
//    splits in order and writes mean, biased and unbiased var, invstd, and the running
//    statistics with eager CUDA's formula (bn_act_device.h): two launches, no ATen op but
//    the allocations.
//  * update_running_stats_: eager CUDA's update, one thread per channel, one launch.
// Contiguous NCHW and channels_last inputs; other layouts and empty inputs take the generic
// path (ATen's batch_norm_update_stats).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../bn_act.h"
#include "../bn_act_device.h"
#include "../bn_act_host_setup.h"
#include "../bn_act_kernels.h"
#include "channel_reduce.cuh"

namespace fxfuse {
namespace {

namespace ew = elementwise;

template <typename T, typename A, typename I>
struct StatsTerms {
  using Acc = ew::Welford<A>;
  const T* x;
  __device__ void setup(I) {}
  __device__ void operator()(I o, Acc& w) const { w.add(static_cast<A>(x[o])); }
};

template <typename A, typename S>
__global__ void finalize_stats_kernel(const A* __restrict__ partial, ew::Splits sp, int64_t C, ew::StatsOut<A, S> o) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < C) ew::finalize_stats_channel<A, S>(partial, sp, C, c, o);
}

template <typename S, typename A>
__global__ void update_running_stats_kernel(
    S* __restrict__ running_mean, S* __restrict__ running_var, const A* __restrict__ mean,
    const A* __restrict__ unbiased_var, A momentum, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < C) {
    running_mean[c] = ew::running_update<S, A>(running_mean[c], mean[c], momentum);
    running_var[c] = ew::running_update<S, A>(running_var[c], unbiased_var[c], momentum);
  }
}

template <typename A>
A* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<A>() : nullptr;
}

}  // namespace

template <>
BatchStats CudaKernels::stats(
    const at::Tensor& input, const ew::Layout& L, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps, bool with_invstd) {
  const c10::cuda::CUDAGuard guard(input.device());
  const auto sd = stats_dtype(input.scalar_type());
  const auto acc = input.options().dtype(sd);
  const int64_t C = L.C, M = L.N * L.HW;
  const ew::Splits sp = cuda::device_splits(L);
  const at::Tensor partial = at::empty({sp.count, 2, C}, acc);
  BatchStats out{
      at::empty({C}, acc), with_invstd ? at::empty({C}, acc) : at::Tensor(), at::empty({C}, acc),
      at::empty({C}, acc)};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "fxfuse::bn_stats_cuda", [&] {
        using A = at::opmath_type<scalar_t>;
        A* part = partial.mutable_data_ptr<A>();
        const scalar_t* x = input.const_data_ptr<scalar_t>();
        if (cuda::fits_32bit(input.numel())) {
          cuda::channel_partials<A, unsigned int>(StatsTerms<scalar_t, A, unsigned int>{x}, L, sp, part);
        } else {
          cuda::channel_partials<A, int64_t>(StatsTerms<scalar_t, A, int64_t>{x}, L, sp, part);
        }
        auto finalize = [&](auto* rm, auto* rv) {
          using S = std::remove_pointer_t<decltype(rm)>;
          const ew::StatsOut<A, S> o{
              out.mean.mutable_data_ptr<A>(), out.var.mutable_data_ptr<A>(),
              out.unbiased_var.mutable_data_ptr<A>(), ptr_or_null<A>(out.invstd), rm, rv,
              static_cast<A>(eps), ew::bessel_factor<A>(M), static_cast<A>(momentum)};
          finalize_stats_kernel<A, S><<<cuda::channel_blocks(C), cuda::kThreads, 0, stream>>>(part, sp, C, o);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (!checks::given(running_mean)) {
          finalize(static_cast<A*>(nullptr), static_cast<A*>(nullptr));
        } else if (running_mean->scalar_type() == sd) {
          finalize(running_mean->mutable_data_ptr<A>(), running_var->mutable_data_ptr<A>());
        } else {
          finalize(running_mean->mutable_data_ptr<scalar_t>(), running_var->mutable_data_ptr<scalar_t>());
        }
      });
  return out;
}

template <>
void CudaKernels::update_running_stats(
    const at::Tensor& running_mean, const at::Tensor& running_var, const at::Tensor& mean,
    const at::Tensor& unbiased_var, double momentum) {
  const c10::cuda::CUDAGuard guard(running_mean.device());
  const int64_t C = running_mean.numel();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, running_mean.scalar_type(), "fxfuse::update_running_stats_cuda", [&] {
        using A = at::opmath_type<scalar_t>;
        const auto ad = c10::CppTypeToScalarType<A>::value;
        const at::Tensor m = ew::in_dtype(mean, ad), u = ew::in_dtype(unbiased_var, ad);
        update_running_stats_kernel<scalar_t, A><<<cuda::channel_blocks(C), cuda::kThreads, 0, stream>>>(
            running_mean.mutable_data_ptr<scalar_t>(), running_var.mutable_data_ptr<scalar_t>(),
            m.const_data_ptr<A>(), u.const_data_ptr<A>(), static_cast<A>(momentum), C);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

BatchStats bn_stats_update_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps) {
  return ew::stats_update<CudaKernels>(input, running_mean, running_var, momentum, eps);
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_cuda(const at::Tensor& input) {
  return ew::bn_stats_op<CudaKernels>(input);
}

void update_running_stats_cuda_(
    at::Tensor& running_mean, at::Tensor& running_var, const at::Tensor& mean,
    const at::Tensor& unbiased_var, double momentum) {
  ew::update_running_stats_op<CudaKernels>(running_mean, running_var, mean, unbiased_var, momentum);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("bn_stats", &bn_stats_cuda);
  m.impl("update_running_stats_", &update_running_stats_cuda_);
}

}  // namespace fxfuse
