// CUDA kernels of fxfuse::bn_act_backward and its in-place forms bn_act_backward_
// (grad_input over the input) and bn_act_backward_into_grad_ (over grad_out), and of the
// backward entry point (bn_act_kernels.h), in three launches:
//  1. the per-split sums of g = dy * act'(z) and of g * (x - mean): a split, coalesced,
//     deterministic reduction over every SM (channel_reduce.cuh);
//  2. a finalize, one thread per channel, summing the splits in order into grad_weight,
//     grad_bias and the grad_input coefficients k1 = sum(g) / M, k2 = sum(g * xhat) / M;
//  3. grad_input, walked in 16-byte vectors where it can be (bn_act_device.h: Walk),
//     written into the destination (a fresh tensor, x or dy: a unit of both is read
//     before it is written).
// Without batch statistics and parameter gradients only the third runs. Coefficients are
// computed inside the kernels from (mean, var or invstd, weight, bias); g is recomputed in
// each pass, never stored: no activation-sized temporary. Contiguous NCHW and channels_last
// inputs of every floating dtype, arithmetic in float for half / bfloat16, 32-bit indexing
// where the tensor allows; other layouts and empty inputs take the generic path.
// Per-element math: bn_act_elementwise.h (its host build is tested on CPU).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
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
struct BackwardTerms {
  using Acc = ew::Sums<A>;
  const T* dy;
  const T* x;
  ew::ChannelParams<A> p;
  Act act;
  A act_param;
  ew::ChannelCoef<A> coef;
  __device__ void setup(I c) { coef = ew::channel_coef(p, c); }
  __device__ void operator()(I o, Acc& s) const {
    ew::backward_terms<T, A>(dy[o], x[o], coef.mean, coef.scale, coef.bias, act, act_param, s.a, s.b);
  }
};

template <typename A>
__global__ void finalize_backward_kernel(
    const A* __restrict__ partial, ew::Splits sp, int64_t C, ew::ChannelParams<A> p, ew::BackwardOut<A> o) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < C) ew::finalize_backward_channel<A>(partial, sp, C, c, p, o);
}

// dst may be x or dy (the in-place forms): no __restrict__ on the three.
template <typename T, typename A, typename I, ew::Walk W>
__global__ void bn_act_backward_input_kernel(
    const T* dy, const T* x, T* dst, ew::ChannelParams<A> p, const A* __restrict__ k, int64_t C,
    bool batch_stats, cuda::UnitChannel<I> channel_of, I units, Act act, A act_param) {
  constexpr int V = W == ew::Walk::Scalar ? 1 : ew::kVec<T>;
  constexpr bool kPixel = W == ew::Walk::Pixel;
  ew::CoefCache<A, V, kPixel, true> cache;
  const I stride = static_cast<I>(blockDim.x) * gridDim.x;
  for (I u = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    ew::grad_input_unit<T, A, V, kPixel>(
        dy, x, dst, static_cast<int64_t>(u) * V, channel_of(u), p, k, C, batch_stats, cache, act,
        act_param);
  }
}

template <typename T, typename A, typename I, ew::Walk W>
void launch_grad_input(
    const T* dy, const T* x, T* dst, const ew::ChannelParams<A>& p, const A* k, bool batch_stats,
    const ew::Layout& L, int64_t n, Act act, A act_param) {
  constexpr int V = W == ew::Walk::Scalar ? 1 : ew::kVec<T>;
  const int64_t units = n / V;
  bn_act_backward_input_kernel<T, A, I, W>
      <<<cuda::walk_blocks(units, L, W, V), cuda::kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          dy, x, dst, p, k, L.C, batch_stats, cuda::unit_channel<I>(L, W, V), static_cast<I>(units),
          act, act_param);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename A>
A* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<A>() : nullptr;
}

}  // namespace

template <>
std::tuple<at::Tensor, at::Tensor> CudaKernels::backward(
    const at::Tensor& dy, const at::Tensor& input, const ew::Layout& L, const at::Tensor& mean,
    const at::Tensor& spread, bool spread_is_var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, Act act, double act_param,
    bool batch_stats, bool need_weight, bool need_bias, const at::Tensor& dst) {
  const c10::cuda::CUDAGuard guard(input.device());
  const auto acc = input.options().dtype(stats_dtype(input.scalar_type()));
  const int64_t C = L.C, n = input.numel();
  const bool need_input = dst.defined();
  const at::Tensor grad_weight = ew::grad_buffer(weight, need_weight, acc, C);
  const at::Tensor grad_bias = ew::grad_buffer(bias, need_bias, acc, C);
  const at::Tensor k = need_input && batch_stats ? at::empty({2, C}, acc) : at::Tensor();
  const bool need_sums = grad_weight.defined() || grad_bias.defined() || k.defined();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "fxfuse::bn_act_backward_cuda", [&] {
        using A = at::opmath_type<scalar_t>;
        const ew::HeldParams<A> held(input, mean, spread, spread_is_var, weight, bias, eps);
        const A ap = static_cast<A>(act_param);
        const scalar_t* x = input.const_data_ptr<scalar_t>();
        const scalar_t* d = dy.const_data_ptr<scalar_t>();
        auto run = [&](auto index) {
          using I = decltype(index);
          if (need_sums) {
            const ew::Splits sp = cuda::device_splits(L);
            const at::Tensor partial = at::empty({sp.count, 2, C}, acc);
            A* part = partial.mutable_data_ptr<A>();
            cuda::channel_partials<A, I>(
                BackwardTerms<scalar_t, A, I>{d, x, held.params, act, ap, {}}, L, sp, part);
            const ew::BackwardOut<A> o{
                ptr_or_null<A>(grad_weight), ptr_or_null<A>(grad_bias), ptr_or_null<A>(k)};
            finalize_backward_kernel<A><<<cuda::channel_blocks(C), cuda::kThreads, 0, stream>>>(
                part, sp, C, held.params, o);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          }
          if (need_input) {
            scalar_t* g = dst.mutable_data_ptr<scalar_t>();
            const A* kp = k.defined() ? k.const_data_ptr<A>() : nullptr;
            switch (ew::choose_walk<scalar_t>(L, d, x, g)) {
              case ew::Walk::Plane:
                launch_grad_input<scalar_t, A, I, ew::Walk::Plane>(d, x, g, held.params, kp, batch_stats, L, n, act, ap);
                break;
              case ew::Walk::Pixel:
                launch_grad_input<scalar_t, A, I, ew::Walk::Pixel>(d, x, g, held.params, kp, batch_stats, L, n, act, ap);
                break;
              case ew::Walk::Scalar:
                launch_grad_input<scalar_t, A, I, ew::Walk::Scalar>(d, x, g, held.params, kp, batch_stats, L, n, act, ap);
                break;
            }
          }
        };
        if (cuda::fits_32bit(n)) {
          run(static_cast<unsigned int>(0));
        } else {
          run(static_cast<int64_t>(0));
        }
      });
  return {ew::in_param_dtype(grad_weight, weight), ew::in_param_dtype(grad_bias, bias)};
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask) {
  return ew::bn_act_backward_op<CudaKernels>(
      grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask);
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_cuda_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  return ew::bn_act_backward_op_<CudaKernels>(
      grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask,
      false);
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_cuda_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  return ew::bn_act_backward_op_<CudaKernels>(
      grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask,
      true);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("bn_act_backward", &bn_act_backward_cuda);
  m.impl("bn_act_backward_", &bn_act_backward_cuda_);
  m.impl("bn_act_backward_into_grad_", &bn_act_backward_into_grad_cuda_);
}

}  // namespace fxfuse
