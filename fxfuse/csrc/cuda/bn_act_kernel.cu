// CUDA kernels of fxfuse::bn_act and fxfuse::bn_act_ (in place): out = act((x - mean) *
// scale + bias), one thread per element (grid-stride loop), for contiguous NCHW and
// channels_last inputs of every floating dtype, arithmetic in float for half / bfloat16;
// other layouts and empty inputs take the generic path. bn_act_ writes over its input
// (each thread reads its element before writing it). The per-element math is
// bn_act_elementwise.h (its host build is tested on CPU), the per-channel coefficients
// bn_act_host_setup.h.
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

// x and out may be the same tensor (bn_act_): no __restrict__ on them.
template <typename T, typename A, typename I>
__global__ void bn_act_forward_kernel(
    const T* x, const A* __restrict__ mean, const A* __restrict__ scale,
    const A* __restrict__ bias, cuda::ChannelOf<I> channel_of, I n, Act act, A act_param, T* out) {
  const I stride = static_cast<I>(blockDim.x) * gridDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const I c = channel_of(i);
    out[i] = ew::forward<T, A>(x[i], mean[c], scale[c], bias[c], act, act_param);
  }
}

// act(bn(input)) into out: a fresh tensor in the input's layout, or the input itself.
void forward_into(
    const at::Tensor& input, const ew::Layout& L, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    Act a, double act_param, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(input.device());
  const auto cf = ew::coefficients(input, mean, var, weight, bias, eps);
  const int64_t n = input.numel();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "fxfuse::bn_act_cuda", [&] {
        using A = at::opmath_type<scalar_t>;
        auto launch = [&](auto index) {
          using I = decltype(index);
          bn_act_forward_kernel<scalar_t, A, I><<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(
              input.const_data_ptr<scalar_t>(), cf.mean.const_data_ptr<A>(),
              cf.scale.const_data_ptr<A>(), cf.bias.const_data_ptr<A>(), cuda::ChannelOf<I>(L),
              static_cast<I>(n), a, static_cast<A>(act_param), out.mutable_data_ptr<scalar_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (cuda::fits_32bit(n)) {
          launch(static_cast<unsigned int>(0));
        } else {
          launch(static_cast<int64_t>(0));
        }
      });
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
  at::Tensor out = at::empty_like(input);
  forward_into(input, layout->first, mean, var, weight, bias, eps, a, act_param, out);
  return out;
}

void bn_act_cuda_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  checks::bn_args(self, mean, var, weight, bias, "bn_act_");
  const Act a = parse_act(act);
  const auto layout = ew::layout_of(self);
  if (!layout || self.numel() == 0) {
    bn_act_generic_(self, mean, var, weight, bias, eps, act, act_param);
    return;
  }
  forward_into(self, layout->first, mean, var, weight, bias, eps, a, act_param, self);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("bn_act", &bn_act_cuda);
  m.impl("bn_act_", &bn_act_cuda_);
}

}  // namespace fxfuse
