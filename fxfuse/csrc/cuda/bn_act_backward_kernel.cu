// CUDA kernels of fxfuse::bn_act_backward and its in-place forms bn_act_backward_
// (grad_input over the input) and bn_act_backward_into_grad_ (over grad_out), in two
// passes over x and dy:
//  1. the per-channel sums of g = dy * act'(z) and of g * (x - mean): a split, coalesced,
//     deterministic reduction over every SM (channel_reduce.cuh);
//  2. grad_input, one thread per element (grid-stride loop), written into the destination
//     (a fresh tensor, x or dy: each thread reads its element before writing it).
// g is recomputed in each pass, never stored: no activation-sized temporary. Contiguous
// NCHW and channels_last inputs of every floating dtype, arithmetic in float for half /
// bfloat16, 32-bit indexing where the tensor allows; other layouts and empty inputs take the
// generic path. Per-element math: bn_act_elementwise.h (its host build is tested on CPU).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../bn_act.h"
#include "../bn_act_elementwise.h"
#include "../activation_ops.h"
#include "../bn_act_host_setup.h"
#include "channel_reduce.cuh"

namespace fxfuse {
namespace {

namespace ew = elementwise;

template <typename T, typename A, typename I>
struct BackwardTerms {
  const T* dy;
  const T* x;
  const A *mean_of, *scale_of, *bias_of;
  Act act;
  A act_param;
  A mean, scale, bias;
  __device__ void setup(I c) {
    mean = mean_of[c];
    scale = scale_of[c];
    bias = bias_of[c];
  }
  __device__ void operator()(I o, A& sum_g, A& sum_gxm) const {
    ew::backward_terms<T, A>(dy[o], x[o], mean, scale, bias, act, act_param, sum_g, sum_gxm);
  }
};

// grad_input may be x or dy (the in-place forms): no __restrict__ on the three.
template <typename T, typename A, typename I>
__global__ void bn_act_backward_input_kernel(
    const T* dy, const T* x, const A* __restrict__ mean, const A* __restrict__ invstd,
    const A* __restrict__ scale, const A* __restrict__ bias, const A* __restrict__ k1,
    const A* __restrict__ k2, bool batch_stats, cuda::ChannelOf<I> channel_of, I n, Act act,
    A act_param, T* grad_input) {
  const I stride = static_cast<I>(blockDim.x) * gridDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const I c = channel_of(i);
    const T dyi = dy[i], xi = x[i];
    const A g = ew::grad_z<T, A>(dyi, xi, mean[c], scale[c], bias[c], act, act_param);
    grad_input[i] = ew::grad_input<T, A>(
        g, xi, mean[c], invstd[c], scale[c], batch_stats ? k1[c] : A(0),
        batch_stats ? k2[c] : A(0), batch_stats);
  }
}

// The parameter gradients; grad_input is written to `dst` when it is defined. dy has the
// input's dtype and layout.
std::tuple<at::Tensor, at::Tensor> backward_into(
    const at::Tensor& dy, const at::Tensor& input, const ew::Layout& L, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, Act a, double act_param, bool batch_stats,
    bool need_weight, bool need_bias, const at::Tensor& dst) {
  const c10::cuda::CUDAGuard guard(input.device());
  const auto cf = ew::coefficients(input, mean, var, weight, bias, eps);
  const int64_t n = input.numel(), M = L.N * L.HW;
  const bool need_input = dst.defined();
  const bool need_sums = need_weight || need_bias || (need_input && batch_stats);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  ew::BackwardSums sums;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "fxfuse::bn_act_backward_cuda", [&] {
        using A = at::opmath_type<scalar_t>;
        const A p = static_cast<A>(act_param);
        auto run = [&](auto index) {
          using I = decltype(index);
          if (need_sums) {
            auto [sum_g, sum_gxm] = cuda::channel_sums<A, I>(
                BackwardTerms<scalar_t, A, I>{
                    dy.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                    cf.mean.const_data_ptr<A>(), cf.scale.const_data_ptr<A>(),
                    cf.bias.const_data_ptr<A>(), a, p, A(0), A(0), A(0)},
                L, cf.mean.options());
            sums = ew::backward_sums(sum_g, sum_gxm, cf, M, batch_stats);
          }
          if (need_input) {
            bn_act_backward_input_kernel<scalar_t, A, I>
                <<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(
                    dy.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                    cf.mean.const_data_ptr<A>(), cf.invstd.const_data_ptr<A>(),
                    cf.scale.const_data_ptr<A>(), cf.bias.const_data_ptr<A>(),
                    batch_stats ? sums.k1.const_data_ptr<A>() : nullptr,
                    batch_stats ? sums.k2.const_data_ptr<A>() : nullptr, batch_stats,
                    cuda::ChannelOf<I>(L), static_cast<I>(n), a, p,
                    dst.mutable_data_ptr<scalar_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          }
        };
        if (cuda::fits_32bit(n)) {
          run(static_cast<unsigned int>(0));
        } else {
          run(static_cast<int64_t>(0));
        }
      });
  return ew::parameter_grads(sums, weight, bias, need_weight, need_bias);
}

// Whether the kernels take this call: a dense layout they index, a non-empty input, and a
// grad_out of the input's sizes on its device.
std::optional<ew::Layout> kernel_layout(const at::Tensor& grad_out, const at::Tensor& input) {
  const auto layout = ew::layout_of(input);
  if (!layout || input.numel() == 0 || !grad_out.defined() ||
      grad_out.device() != input.device() || grad_out.sizes() != input.sizes()) {
    return std::nullopt;
  }
  return layout->first;
}

at::Tensor dy_like(const at::Tensor& grad_out, const at::Tensor& input) {
  return grad_out.to(input.scalar_type()).contiguous(input.suggest_memory_format());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward");
  const Act a = parse_act(act);
  const auto L = kernel_layout(grad_out, input);
  if (!L) {
    return bn_act_backward_generic(
        grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
        output_mask);
  }
  at::Tensor grad_input = output_mask[0] ? at::empty_like(input) : at::Tensor();
  auto [grad_weight, grad_bias] = backward_into(
      dy_like(grad_out, input), input, *L, mean, var, weight, bias, eps, a, act_param,
      batch_stats, output_mask[1], output_mask[2], grad_input);
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_cuda_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward_");
  const Act a = parse_act(act);
  const auto L = kernel_layout(grad_out, input);
  if (!L) {
    return bn_act_backward_generic_(
        grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
        output_mask);
  }
  const at::Tensor dy = dy_like(grad_out, input);
  at::assert_no_partial_overlap(dy, input);
  return backward_into(
      dy, input, *L, mean, var, weight, bias, eps, a, act_param, batch_stats, output_mask[0],
      output_mask[1], input);
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_cuda_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward_into_grad_");
  const Act a = parse_act(act);
  const auto L = kernel_layout(grad_out, input);
  // Truly in place when grad_out already has the input's dtype and layout (the kernels
  // read it as dy); otherwise the generic form (grad_input, then a copy over grad_out).
  if (!L || grad_out.scalar_type() != input.scalar_type() ||
      !grad_out.is_contiguous(input.suggest_memory_format())) {
    return bn_act_backward_into_grad_generic_(
        grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
        output_mask);
  }
  at::assert_no_partial_overlap(grad_out, input);
  return backward_into(
      grad_out, input, *L, mean, var, weight, bias, eps, a, act_param, batch_stats,
      output_mask[0], output_mask[1], grad_out);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("bn_act_backward", &bn_act_backward_cuda);
  m.impl("bn_act_backward_", &bn_act_backward_cuda_);
  m.impl("bn_act_backward_into_grad_", &bn_act_backward_into_grad_cuda_);
}

}  // namespace fxfuse
