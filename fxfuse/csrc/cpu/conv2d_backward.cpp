// CPU conv2d_backward: ATen's convolution_backward, except for the weight and bias gradients
// of a depthwise convolution (groups == in_channels == out_channels) in float64, or in float32
// with a kernel of 5x5 or more, which come from fxfuse's kernel (depthwise_kernel_impl.h:
// 4-20x faster than oneDNN's weight gradient there). The input gradient is always ATen's (oneDNN's is fast).
// The kernel reads channels_last memory; an input in another layout is copied to it first,
// which still costs far less than the weight gradient it replaces.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../checks.h"
#include "../conv_ops.h"
#include "../generic_path.h"
#include "depthwise_kernel.h"

namespace fxfuse {
namespace {

template <typename T>
const cpu::DepthwiseKernelTable<T>& depthwise_kernel_table() {
#if FXFUSE_HAVE_AVX2_KERNELS
  if (cpu::use_avx2_kernels()) return cpu::AVX2::depthwise_kernels<T>();
#endif
  return cpu::DEFAULT::depthwise_kernels<T>();
}

constexpr int64_t kMinFloatKernelArea = 25;

bool plain_dense(const at::Tensor& t, at::ScalarType dtype) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.scalar_type() == dtype &&
      !t.is_neg() && t.numel() > 0;
}

// The output size along one dimension, as ATen computes it; -1 for invalid arguments.
int64_t output_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
  if (s <= 0 || p < 0 || d <= 0) return -1;
  const int64_t span = in + 2 * p - d * (k - 1) - 1;
  return span < 0 ? -1 : span / s + 1;
}

// Whether the kernel takes this convolution. Anything it does not (other dtypes, groups,
// ranks, inconsistent shapes, which eager rejects) goes to ATen, which raises eager's errors.
bool depthwise_kernel_applies(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    int64_t groups, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  if (stride.size() != 2 || padding.size() != 2 || dilation.size() != 2) return false;
  const auto dtype = input.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  if (input.dim() != 4 || weight.dim() != 4 || grad_out.dim() != 4) return false;
  if (!plain_dense(input, dtype) || !plain_dense(weight, dtype) || !plain_dense(grad_out, dtype)) {
    return false;
  }
  // float32 kernels under 5x5: oneDNN's weight gradient is as fast as this kernel (measured
  // on 3x3 layers of EfficientNet / MobileNet), so ATen keeps them, rounding included.
  if (dtype == at::kFloat && weight.size(2) * weight.size(3) < kMinFloatKernelArea) return false;
  const int64_t C = input.size(1);
  return groups == C && weight.size(0) == C && weight.size(1) == 1 &&
      grad_out.size(0) == input.size(0) && grad_out.size(1) == C &&
      grad_out.size(2) == output_size(input.size(2), weight.size(2), stride[0], padding[0], dilation[0]) &&
      grad_out.size(3) == output_size(input.size(3), weight.size(3), stride[1], padding[1], dilation[1]);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  const bool want_bias = output_mask[2] && checks::given(bias);
  if (!(output_mask[1] || want_bias) || generic_path() ||
      !depthwise_kernel_applies(grad_out, input, weight, groups, stride, padding, dilation)) {
    return conv2d_backward_generic(
        grad_out, input, weight, bias, stride, padding, dilation, groups, output_mask);
  }
  at::Tensor grad_input;
  if (output_mask[0]) {
    grad_input = std::get<0>(conv2d_backward_generic(
        grad_out, input, weight, std::nullopt, stride, padding, dilation, groups,
        {true, false, false}));
  }
  const auto cl = at::MemoryFormat::ChannelsLast;
  const at::Tensor x = input.contiguous(cl);
  const at::Tensor gy = grad_out.contiguous(cl);
  // The layout ATen's CPU convolutions give the weight gradient: channels_last for a
  // channels_last float32 input (oneDNN), contiguous otherwise.
  const bool cl_weight = input.scalar_type() == at::kFloat && input.suggest_memory_format() == cl;
  at::Tensor grad_weight =
      at::empty(weight.sizes(), weight.options().memory_format(cl_weight ? cl : at::MemoryFormat::Contiguous));
  at::Tensor grad_bias = want_bias ? at::empty({input.size(1)}, input.options()) : at::Tensor();
  const cpu::DepthwiseGeometry g{
      input.size(0), input.size(1), input.size(2), input.size(3), grad_out.size(2), grad_out.size(3),
      weight.size(2), weight.size(3), stride[0], stride[1], padding[0], padding[1], dilation[0],
      dilation[1]};
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "fxfuse::conv2d_backward", [&] {
    depthwise_kernel_table<scalar_t>().weight_grad(
        x.const_data_ptr<scalar_t>(), gy.const_data_ptr<scalar_t>(),
        grad_weight.mutable_data_ptr<scalar_t>(),
        want_bias ? grad_bias.mutable_data_ptr<scalar_t>() : nullptr, g);
  });
  if (!output_mask[1]) grad_weight = at::Tensor();
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, CPU, m) {
  m.impl("conv2d_backward", &conv2d_backward_cpu);
}

}  // namespace fxfuse
