// F.linear(F.layer_norm(F.conv2d(input, ...).permute(0, 2, 3, 1), ...), weight, bias) that keeps
// only the conv's input (and the parameters) for backward: ConvNeXt's depthwise conv ->
// LayerNorm -> fc1. Eager keeps the conv input (its weight gradient), the conv output (the layer
// norm's input) and the layer norm's output (fc1's input); layer_norm_linear drops the last, this
// op the conv output too. The backward op runs the conv again (a depthwise conv costs about as
// much as one pass over its output), then layer_norm_linear's backward and the conv's backward
// (fxfuse::conv2d_backward). No matmul runs twice.
//
// Forward is the ATen calls eager makes, so the output is eager's bit for bit; the gradients
// are layer_norm_linear's (eager's bits) and conv2d_backward's. Built from ATen calls and fxfuse
// ops, registered as CompositeExplicitAutograd: one implementation for every device.
#include <ATen/ops/convolution.h>
#include <torch/library.h>

#include <array>
#include <tuple>

#include "../checks.h"
#include "../conv_ops.h"
#include "../dispatch.h"
#include "../norm_ops.h"

namespace fxfuse {
namespace {

at::Tensor conv_channels_last_view(
    const at::Tensor& input, const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    const char* op) {
  TORCH_CHECK(
      input.dim() == 4, "fxfuse::", op, ": expected a 4-D (N, C, H, W) input, got ", input.dim(), "-D");
  return conv2d_generic(input, conv_weight, conv_bias, stride, padding, dilation, groups)
      .permute({0, 2, 3, 1});
}

at::Tensor conv_layer_norm_linear(
    const at::Tensor& input, const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& ln_weight,
    const std::optional<at::Tensor>& ln_bias, double eps, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const at::Tensor z = conv_channels_last_view(
      input, conv_weight, conv_bias, stride, padding, dilation, groups, "conv_layer_norm_linear");
  return layer_norm_linear(z, normalized_shape, ln_weight, ln_bias, eps, weight, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
conv_layer_norm_linear_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& conv_weight,
    const std::optional<at::Tensor>& conv_bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
    double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 7> output_mask) {
  const bool need_conv =
      output_mask[0] || output_mask[1] || (output_mask[2] && checks::given(conv_bias));
  // The conv output this op did not keep.
  at::Tensor z = conv_channels_last_view(
      input, conv_weight, conv_bias, stride, padding, dilation, groups,
      "conv_layer_norm_linear_backward");
  auto [grad_z, grad_ln_weight, grad_ln_bias, grad_weight, grad_bias] = layer_norm_linear_backward(
      grad_out, z, normalized_shape, ln_weight, ln_bias, eps, weight, bias,
      {need_conv, output_mask[3], output_mask[4], output_mask[5], output_mask[6]});
  z.reset();
  at::Tensor grad_input, grad_conv_weight, grad_conv_bias;
  if (need_conv) {
    std::tie(grad_input, grad_conv_weight, grad_conv_bias) = dispatch::conv2d_backward(
        grad_z.permute({0, 3, 1, 2}), input, conv_weight, conv_bias, stride, padding, dilation,
        groups, {output_mask[0], output_mask[1], output_mask[2]});
  }
  return {grad_input,     grad_conv_weight, grad_conv_bias, grad_ln_weight,
          grad_ln_bias,   grad_weight,      grad_bias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // F.linear(F.layer_norm(F.conv2d(input, ...).permute(0, 2, 3, 1), ...), weight, bias) that
  // keeps only the conv's input and the parameters (the conv runs again in backward).
  m.def(
      "conv_layer_norm_linear(Tensor input, Tensor conv_weight, Tensor? conv_bias, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups, int[] normalized_shape, Tensor? ln_weight, "
      "Tensor? ln_bias, float eps, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "conv_layer_norm_linear_backward(Tensor grad_out, Tensor input, Tensor conv_weight, "
      "Tensor? conv_bias, int[2] stride, int[2] padding, int[2] dilation, int groups, "
      "int[] normalized_shape, Tensor? ln_weight, Tensor? ln_bias, float eps, Tensor weight, "
      "Tensor? bias, bool[7] output_mask) -> (Tensor grad_input, Tensor grad_conv_weight, "
      "Tensor grad_conv_bias, Tensor grad_ln_weight, Tensor grad_ln_bias, Tensor grad_weight, "
      "Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("conv_layer_norm_linear", &conv_layer_norm_linear);
  m.impl("conv_layer_norm_linear_backward", &conv_layer_norm_linear_backward);
}

}  // namespace fxfuse
