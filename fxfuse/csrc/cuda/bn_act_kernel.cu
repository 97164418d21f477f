// CUDA kernel of fxfuse::bn_act: out = act((x - mean) * scale + bias), one thread
// per element (grid-stride loop), for contiguous NCHW and channels_last inputs of
// every floating dtype; other layouts and empty inputs take the generic path.
// The per-element math is bn_act_elementwise.h (its host build is tested on CPU),
// the per-channel coefficients bn_act_plan.h.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../bn_act.h"
#include "../bn_act_elementwise.h"
#include "../activation_ops.h"
#include "../bn_act_host_setup.h"
#include "launch.cuh"

namespace fxfuse {
namespace {

namespace ew = elementwise;

template <typename T, typename A>
__global__ void bn_act_forward_kernel(
    const T* __restrict__ x, const A* __restrict__ mean, const A* __restrict__ scale,
    const A* __restrict__ bias, ew::Layout layout, int64_t n, Act act, A act_param,
    T* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t c = layout.channel(i);
    out[i] = ew::forward<T, A>(x[i], mean[c], scale[c], bias[c], act, act_param);
  }
}

at::Tensor bn_act_cuda(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act");
  const Act a = parse_act(act);
  const auto layout = ew::layout_of(input);
  if (!layout || input.numel() == 0) {
    return bn_act_generic(input, mean, var, weight, bias, eps, act, act_param);
  }
  const c10::cuda::CUDAGuard guard(input.device());
  const auto cf = ew::coefficients(input, mean, var, weight, bias, eps);
  at::Tensor out = at::empty_like(input);
  const int64_t n = input.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "fxfuse::bn_act_cuda", [&] {
        using A = at::opmath_type<scalar_t>;
        bn_act_forward_kernel<scalar_t, A>
            <<<cuda::grid_for(n), cuda::kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                input.const_data_ptr<scalar_t>(), cf.mean.const_data_ptr<A>(),
                cf.scale.const_data_ptr<A>(), cf.bias.const_data_ptr<A>(), layout->first, n, a,
                static_cast<A>(act_param), out.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("bn_act", &bn_act_cuda);
}

}  // namespace fxfuse
