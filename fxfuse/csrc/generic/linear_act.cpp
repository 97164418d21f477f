// act(F.linear(input, weight, bias)) that keeps only the layer's input and parameters for
// backward: the backward op recomputes the pre-activation y = linear(input), takes the gradient
// through the activation, then runs the linear's backward. Built from ATen calls only (the
// matmul dominates), registered as CompositeExplicitAutograd: one implementation for every
// device. Forward computes exactly act(F.linear(...)): the same ATen linear, then the same ATen
// activation applied in place to the fresh layer output (no second wide buffer).
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include "../activation_ops.h"
#include "../checks.h"

namespace fxfuse {

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

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // act(F.linear(input, weight, bias)) that keeps only input, weight and bias for backward.
  m.def(
      "linear_act(Tensor input, Tensor weight, Tensor? bias, str act, float act_param) "
      "-> Tensor");
  m.def(
      "linear_act_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "str act, float act_param, bool[3] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("linear_act", &linear_act);
  m.impl("linear_act_backward", &linear_act_backward);
}

}  // namespace fxfuse
