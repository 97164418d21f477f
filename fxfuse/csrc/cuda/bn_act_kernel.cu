// CUDA kernel of fxfuse::bn_act and fxfuse::bn_act_ (in place), and of the apply entry
// point (bn_act_kernels.h): out = act((x - mean) * scale + bias), one launch, the
// per-channel coefficients computed inside the kernel from (mean, var or invstd, weight,
// bias) and kept per thread while its channels do not change. Memory is walked in 16-byte
// vectors where the pointers are aligned and a vector never straddles what the
// coefficients index (bn_act_device.h: Walk), else element by element. Contiguous NCHW and
// channels_last inputs of every floating dtype, arithmetic in float for half / bfloat16;
// other layouts and empty inputs take the generic path. bn_act_ writes over its input (a
// unit is read whole before it is written). Per-element math: bn_act_elementwise.h, whose
// host build is tested on CPU.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../bn_act.h"
#include "../bn_act_device.h"
#include "../bn_act_host_setup.h"
#include "../bn_act_kernels.h"
#include "launch.cuh"

namespace fxfuse {
namespace {

namespace ew = elementwise;

// x and out may be the same tensor (bn_act_): no __restrict__ on them.
template <typename T, typename A, typename I, ew::Walk W>
__global__ void bn_act_forward_kernel(
    const T* x, T* out, ew::ChannelParams<A> p, cuda::UnitChannel<I> channel_of, I units, Act act,
    A act_param) {
  constexpr int V = W == ew::Walk::Scalar ? 1 : ew::kVec<T>;
  constexpr bool kPixel = W == ew::Walk::Pixel;
  ew::CoefCache<A, V, kPixel, false> cache;
  const I stride = static_cast<I>(blockDim.x) * gridDim.x;
  for (I u = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    ew::forward_unit<T, A, V, kPixel>(
        x, out, static_cast<int64_t>(u) * V, channel_of(u), p, cache, act, act_param);
  }
}

template <typename T, typename A, typename I, ew::Walk W>
void launch_forward(
    const T* x, T* out, const ew::ChannelParams<A>& p, const ew::Layout& L, int64_t n, Act act,
    A act_param) {
  constexpr int V = W == ew::Walk::Scalar ? 1 : ew::kVec<T>;
  const int64_t units = n / V;
  bn_act_forward_kernel<T, A, I, W>
      <<<cuda::walk_blocks(units, L, W, V), cuda::kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          x, out, p, cuda::unit_channel<I>(L, W, V), static_cast<I>(units), act, act_param);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

template <>
void CudaKernels::apply(
    const at::Tensor& input, const ew::Layout& L, const at::Tensor& mean, const at::Tensor& spread,
    bool spread_is_var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, Act act, double act_param,
    const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t n = input.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "fxfuse::bn_act_cuda", [&] {
        using A = at::opmath_type<scalar_t>;
        const ew::HeldParams<A> held(input, mean, spread, spread_is_var, weight, bias, eps);
        const scalar_t* x = input.const_data_ptr<scalar_t>();
        scalar_t* y = out.mutable_data_ptr<scalar_t>();
        const A ap = static_cast<A>(act_param);
        auto run = [&](auto index) {
          using I = decltype(index);
          switch (ew::choose_walk<scalar_t>(L, x, y, y)) {
            case ew::Walk::Plane:
              launch_forward<scalar_t, A, I, ew::Walk::Plane>(x, y, held.params, L, n, act, ap);
              break;
            case ew::Walk::Pixel:
              launch_forward<scalar_t, A, I, ew::Walk::Pixel>(x, y, held.params, L, n, act, ap);
              break;
            case ew::Walk::Scalar:
              launch_forward<scalar_t, A, I, ew::Walk::Scalar>(x, y, held.params, L, n, act, ap);
              break;
          }
        };
        if (cuda::fits_32bit(n)) {
          run(static_cast<unsigned int>(0));
        } else {
          run(static_cast<int64_t>(0));
        }
      });
}

namespace {

at::Tensor bn_act_cuda(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  return ew::bn_act_op<CudaKernels>(input, mean, var, weight, bias, eps, act, act_param);
}

void bn_act_cuda_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  ew::bn_act_op_<CudaKernels>(self, mean, var, weight, bias, eps, act, act_param);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("bn_act", &bn_act_cuda);
  m.impl("bn_act_", &bn_act_cuda_);
}

}  // namespace fxfuse
