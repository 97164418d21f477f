// Linear -> activation and Conv2d -> activation that keep only the layer's input
// (and parameters) for backward, and activation -> Linear, which keeps only the
// activation's input. The backward ops recompute the pre-activation
// y = linear(x) / conv2d(x), take the gradient through the activation, then run
// the layer's backward. Built from ATen calls only (the matmul / convolution
// dominates), registered as CompositeExplicitAutograd: one implementation for
// every device.
//
// Forward computes exactly act(F.linear(...)) / act(F.conv2d(...)): the same ATen
// layer op, then the same ATen activation, applied in place to the fresh layer
// output (no second wide buffer). The result has the layer output's layout
// (at::convolution's: channels_last in, channels_last out).
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
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

at::Tensor linear_act(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  checks::linear_args(input, weight, bias, "linear_act");
  const Act a = parse_act(act);
  at::Tensor y = at::linear(input, weight, bias);
  return act_forward_(y, a, act_param);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_act_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, c10::string_view act, double act_param,
    std::array<bool, 3> output_mask) {
  checks::linear_args(input, weight, bias, "linear_act_backward");
  const Act a = parse_act(act);
  const bool has_bias = checks::given(bias);
  if (!(output_mask[0] || output_mask[1] || (output_mask[2] && has_bias))) return {};
  // Gradient w.r.t. the pre-activation y = linear(input), recomputed here: the
  // one activation the forward did not keep.
  const at::Tensor g = a == Act::None
      ? grad_out
      : act_backward(grad_out, at::linear(input, weight, bias), a, act_param);

  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = at::matmul(g, weight);
  if (output_mask[1] || (output_mask[2] && has_bias)) {
    // Leading dimensions flattened: g2 is (rows, out_features), x2 (rows, in_features).
    const at::Tensor g2 = g.reshape({-1, weight.size(0)});
    if (output_mask[1]) grad_weight = at::mm(g2.t(), input.reshape({-1, weight.size(1)}));
    if (output_mask[2] && has_bias) grad_bias = g2.sum(0);
  }
  return {grad_input, grad_weight, grad_bias};
}

// linear(act(input)): eager keeps both input (for the activation's backward) and
// act(input) (for the weight gradient); this keeps input alone and recomputes
// act(input), one pointwise pass, for the weight gradient.
at::Tensor act_linear(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  checks::linear_args(input, weight, bias, "act_linear");
  const Act a = parse_act(act);
  return at::linear(act_forward(input, a, act_param), weight, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> act_linear_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, c10::string_view act, double act_param,
    std::array<bool, 3> output_mask) {
  checks::linear_args(input, weight, bias, "act_linear_backward");
  const Act a = parse_act(act);
  const bool has_bias = checks::given(bias);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[1] || (output_mask[2] && has_bias)) {
    const at::Tensor g2 = grad_out.reshape({-1, weight.size(0)});
    // The recomputed activation lives only for this product.
    if (output_mask[1]) {
      grad_weight = at::mm(g2.t(), act_forward(input, a, act_param).reshape({-1, weight.size(1)}));
    }
    if (output_mask[2] && has_bias) grad_bias = g2.sum(0);
  }
  if (output_mask[0]) grad_input = act_backward(at::matmul(grad_out, weight), input, a, act_param);
  return {grad_input, grad_weight, grad_bias};
}

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

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("linear_act", &linear_act);
  m.impl("linear_act_backward", &linear_act_backward);
  m.impl("act_linear", &act_linear);
  m.impl("act_linear_backward", &act_linear_backward);
  m.impl("conv_act", &conv_act);
  m.impl("conv_act_backward", &conv_act_backward);
}

}  // namespace fxfuse
