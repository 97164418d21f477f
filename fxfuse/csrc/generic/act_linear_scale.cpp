// F.linear(act(input), weight, bias) * scale, with a scale per output feature (a LayerScale:
// ConvNeXt's layer_scale, CaiT's and DeiT-III's gamma), that keeps only the input and the
// parameters for backward. Eager's multiply keeps the linear's output for the scale's gradient;
// here that gradient comes from the product the weight gradient needs anyway:
//   M = grad_out^T act(input)              (out_features x in_features)
//   grad_weight = scale * M                (row c scaled by scale[c])
//   grad_scale  = sum_k weight ⊙ M + bias * sum_rows(grad_out)
//   grad_bias   = scale * sum_rows(grad_out)
// Exact in real arithmetic; the weight's, bias's and scale's gradients round differently from
// eager's (the same matmuls, scaled before instead of after). The forward and the input's
// gradient are eager's ATen calls in eager's order. act may be "none" (a plain Linear).
//
// Mixed dtypes, torch.autocast's form (the Autocast kernel passes the weight and bias cast to
// the autocast dtype, the input and the scale as they are): the activation runs in the input's
// dtype and its output is cast to the weight's for the linear, whose output the scale multiplies
// with type promotion (a float32 scale gives a float32 result). There the backward is eager's
// ATen calls with eager's casts: the scale's gradient needs the linear's output, which it
// recomputes (one more matmul) rather than keep, so every gradient is eager's bit for bit.
#include <ATen/ExpandUtils.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <array>
#include <tuple>

#include "../activation_ops.h"
#include "../checks.h"

namespace fxfuse {
namespace {

void check_args(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& scale, const char* op) {
  checks::linear_args(input, weight, bias, op);
  TORCH_CHECK(
      scale.dim() == 1 && scale.size(0) == weight.size(0), "fxfuse::", op,
      ": expected a scale of shape [", weight.size(0), "] (one per output feature), got shape ",
      scale.sizes());
}

}  // namespace

at::Tensor act_linear_scale(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& scale, c10::string_view act, double act_param) {
  check_args(input, weight, bias, scale, "act_linear_scale");
  at::Tensor y = at::linear(
      act_forward(input, parse_act(act), act_param).to(weight.scalar_type()), weight, bias);
  if (scale.scalar_type() != y.scalar_type()) return y.mul(scale);  // promoted, as eager's
  return y.mul_(scale);  // eager's out-of-place multiply, same products, into the fresh output
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> act_linear_scale_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& scale, c10::string_view act,
    double act_param, std::array<bool, 4> output_mask) {
  check_args(input, weight, bias, scale, "act_linear_scale_backward");
  const Act a = parse_act(act);
  const bool has_bias = checks::given(bias);
  at::Tensor grad_input, grad_weight, grad_bias, grad_scale;
  if (input.scalar_type() != weight.scalar_type() || scale.scalar_type() != weight.scalar_type()) {
    const auto dtype = weight.scalar_type();
    const at::Tensor x = act_forward(input, a, act_param).to(dtype);  // the linear's input
    if (output_mask[3]) {  // mul's backward, grad * y, summed to the scale's shape, then its dtype
      grad_scale = at::sum_to(grad_out.mul(at::linear(x, weight, bias)), scale.sizes())
                       .to(scale.scalar_type());
    }
    const at::Tensor g = grad_out.mul(scale).to(dtype);  // the linear's output gradient
    const at::Tensor g2 = g.reshape({-1, weight.size(0)});
    if (output_mask[1]) grad_weight = at::mm(g2.t(), x.reshape({-1, weight.size(1)}));
    if (output_mask[2] && has_bias) grad_bias = g2.sum(0);
    if (output_mask[0]) {
      grad_input = act_backward(at::matmul(g, weight).to(input.scalar_type()), input, a, act_param);
    }
    return {grad_input, grad_weight, grad_bias, grad_scale};
  }
  const at::Tensor g2 = grad_out.reshape({-1, weight.size(0)});
  at::Tensor column_sum;
  if (has_bias && (output_mask[2] || output_mask[3])) column_sum = g2.sum(0);
  if (output_mask[1] || output_mask[3]) {
    // The recomputed activation lives only for this product.
    const at::Tensor m = at::mm(g2.t(), act_forward(input, a, act_param).reshape({-1, weight.size(1)}));
    if (output_mask[3]) {
      grad_scale = m.mul(weight).sum(1);
      if (has_bias) grad_scale.add_(column_sum.mul(*bias));
    }
    if (output_mask[1]) grad_weight = m.mul_(scale.unsqueeze(1));
  }
  if (output_mask[2] && has_bias) grad_bias = column_sum.mul_(scale);
  if (output_mask[0]) {
    grad_input = act_backward(at::matmul(grad_out.mul(scale), weight), input, a, act_param);
  }
  return {grad_input, grad_weight, grad_bias, grad_scale};
}

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // F.linear(act(input), weight, bias) * scale (one scale per output feature) that keeps only
  // input and the parameters for backward.
  m.def(
      "act_linear_scale(Tensor input, Tensor weight, Tensor? bias, Tensor scale, str act, "
      "float act_param) -> Tensor");
  m.def(
      "act_linear_scale_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "Tensor scale, str act, float act_param, bool[4] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias, Tensor grad_scale)");
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("act_linear_scale", &act_linear_scale);
  m.impl("act_linear_scale_backward", &act_linear_scale_backward);
}

}  // namespace fxfuse
