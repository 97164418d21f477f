// CUDA kernels of fxfuse::bn_act_backward, in two passes over x and dy:
//  1. per-channel sums of g = dy * act'(z) and of g * (x - mean): one block per
//     channel, each thread striding over the channel's elements, then a
//     fixed-order block reduction (deterministic);
//  2. grad_input, one thread per element (grid-stride loop).
// g is recomputed in each pass, never stored. Contiguous NCHW and channels_last
// inputs of every floating dtype; other layouts and empty inputs take the generic
// path. Per-element math: bn_act_elementwise.h (its host build is tested on CPU).
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
__global__ void bn_act_backward_reduce_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, const A* __restrict__ mean,
    const A* __restrict__ invstd, const A* __restrict__ scale, const A* __restrict__ bias,
    ew::Layout layout, Act act, A act_param, A* __restrict__ sum_g, A* __restrict__ sum_gx) {
  __shared__ A shared[cuda::kThreads];
  const int64_t c = blockIdx.x;
  const int64_t m = layout.N * layout.HW;
  A sg = A(0), sgxm = A(0);
  for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
    const int64_t o = layout.offset(c, j);
    const A g = ew::grad_z<T, A>(dy[o], x[o], mean[c], scale[c], bias[c], act, act_param);
    sg += g;
    sgxm += g * (static_cast<A>(x[o]) - mean[c]);
  }
  sg = cuda::block_sum(sg, shared);
  sgxm = cuda::block_sum(sgxm, shared);
  if (threadIdx.x == 0) {
    sum_g[c] = sg;
    sum_gx[c] = sgxm * invstd[c];
  }
}

template <typename T, typename A>
__global__ void bn_act_backward_input_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, const A* __restrict__ mean,
    const A* __restrict__ invstd, const A* __restrict__ scale, const A* __restrict__ bias,
    const A* __restrict__ k1, const A* __restrict__ k2, bool batch_stats, ew::Layout layout,
    int64_t n, Act act, A act_param, T* __restrict__ grad_input) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t c = layout.channel(i);
    const A g = ew::grad_z<T, A>(dy[i], x[i], mean[c], scale[c], bias[c], act, act_param);
    grad_input[i] = ew::grad_input<T, A>(
        g, x[i], mean[c], invstd[c], scale[c], batch_stats ? k1[c] : A(0),
        batch_stats ? k2[c] : A(0), batch_stats);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward");
  const Act a = parse_act(act);
  const auto layout = ew::layout_of(input);
  if (!layout || input.numel() == 0 || !grad_out.defined() ||
      grad_out.device() != input.device() || grad_out.sizes() != input.sizes()) {
    return bn_act_backward_generic(
        grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
        output_mask);
  }
  const c10::cuda::CUDAGuard guard(input.device());
  const auto cf = ew::coefficients(input, mean, var, weight, bias, eps);
  const at::Tensor dy = grad_out.to(input.scalar_type()).contiguous(layout->second);
  const ew::Layout L = layout->first;
  const int64_t n = input.numel(), m = L.N * L.HW;
  const bool need_sums = output_mask[1] || output_mask[2] || (output_mask[0] && batch_stats);
  const auto stream = c10::cuda::getCurrentCUDAStream();

  at::Tensor sum_g, sum_gx, grad_input, grad_weight, grad_bias;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "fxfuse::bn_act_backward_cuda", [&] {
        using A = at::opmath_type<scalar_t>;
        const A p = static_cast<A>(act_param);
        if (need_sums) {
          sum_g = at::empty({L.C}, cf.mean.options());
          sum_gx = at::empty({L.C}, cf.mean.options());
          bn_act_backward_reduce_kernel<scalar_t, A>
              <<<static_cast<unsigned int>(L.C), cuda::kThreads, 0, stream>>>(
                  dy.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                  cf.mean.const_data_ptr<A>(), cf.invstd.const_data_ptr<A>(),
                  cf.scale.const_data_ptr<A>(), cf.bias.const_data_ptr<A>(), L, a, p,
                  sum_g.mutable_data_ptr<A>(), sum_gx.mutable_data_ptr<A>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        if (output_mask[0]) {
          at::Tensor k1, k2;
          if (batch_stats) {
            k1 = sum_g / static_cast<double>(m);
            k2 = sum_gx / static_cast<double>(m);
          }
          grad_input = at::empty_like(input);
          bn_act_backward_input_kernel<scalar_t, A>
              <<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(
                  dy.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                  cf.mean.const_data_ptr<A>(), cf.invstd.const_data_ptr<A>(),
                  cf.scale.const_data_ptr<A>(), cf.bias.const_data_ptr<A>(),
                  batch_stats ? k1.const_data_ptr<A>() : nullptr,
                  batch_stats ? k2.const_data_ptr<A>() : nullptr, batch_stats, L, n, a, p,
                  grad_input.mutable_data_ptr<scalar_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
  if (output_mask[1] && weight.has_value() && weight->defined()) {
    grad_weight = sum_gx.to(weight->scalar_type());
  }
  if (output_mask[2] && bias.has_value() && bias->defined()) grad_bias = sum_g.to(bias->scalar_type());
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("bn_act_backward", &bn_act_backward_cuda);
}

}  // namespace fxfuse
