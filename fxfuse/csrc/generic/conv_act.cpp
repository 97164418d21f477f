// act(F.conv2d(input, weight, bias, ...)) that keeps only the layer's input and parameters for
// backward: the backward op recomputes the conv output, takes the gradient through the
// activation, then runs fxfuse::conv2d_backward's implementation. Built from ATen calls only
// (the convolution dominates), registered as CompositeExplicitAutograd: one implementation for
// every device. Forward computes exactly act(F.conv2d(...)): the same ATen convolution, then the
// same ATen activation applied in place to the fresh output, which keeps at::convolution's
// layout (channels_last in, channels_last out).
#include <torch/library.h>

#include "../activation_ops.h"
#include "../checks.h"
#include "../conv_ops.h"
#include "../dispatch.h"

namespace fxfuse {
namespace {

void check_conv_args(const at::Tensor& input, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(
      input.dim() == 4, "fxfuse::", op, ": expected a 4-D (N, C, H, W) input, got ",
      input.dim(), "-D");
  TORCH_CHECK(
      weight.dim() == 4, "fxfuse::", op,
      ": expected a 4-D (out_channels, in_channels / groups, kH, kW) weight, got ",
      weight.dim(), "-D");
}

}  // namespace

at::Tensor conv_act(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    c10::string_view act, double act_param) {
  check_conv_args(input, weight, "conv_act");
  const Act a = parse_act(act);
  at::Tensor y = conv2d_generic(input, weight, bias, stride, padding, dilation, groups);
  return act_forward_(y, a, act_param);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_act_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, c10::string_view act, double act_param,
    std::array<bool, 3> output_mask) {
  check_conv_args(input, weight, "conv_act_backward");
  const Act a = parse_act(act);
  const bool has_bias = checks::given(bias);
  if (!(output_mask[0] || output_mask[1] || (output_mask[2] && has_bias))) return {};
  // Recompute the conv output: the one activation this op did not keep.
  const at::Tensor grad_y = a == Act::None
      ? grad_out
      : act_backward(
            grad_out, conv2d_generic(input, weight, bias, stride, padding, dilation, groups), a,
            act_param);
  return dispatch::conv2d_backward(
      grad_y, input, weight, bias, stride, padding, dilation, groups, output_mask);
}

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // act(F.conv2d(input, weight, bias, ...)) that keeps only input, weight and bias.
  m.def(
      "conv_act(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, str act, float act_param) -> Tensor");
  m.def(
      "conv_act_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "int[2] stride, int[2] padding, int[2] dilation, int groups, str act, float act_param, "
      "bool[3] output_mask) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("conv_act", &conv_act);
  m.impl("conv_act_backward", &conv_act_backward);
}

}  // namespace fxfuse
