// F.linear(act(input), weight, bias) that keeps only the activation's input (and the layer's
// parameters) for backward. Built from ATen calls only (the matmul dominates), registered as
// CompositeExplicitAutograd: one implementation for every device.
//
// The linear runs in the weight's dtype: an activation output of another dtype is cast to it,
// as torch.autocast casts F.linear's input (the op's Autocast kernel passes the cast weight and
// the uncast input, so the activation runs in the input's dtype, as in eager). The backward
// casts the linear's input gradient back, as autograd does through eager's cast.
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include "../activation_ops.h"
#include "../checks.h"

namespace fxfuse {

// linear(act(input)): eager keeps both input (for the activation's backward) and
// act(input) (for the weight gradient); this keeps input alone and recomputes
// act(input), one pointwise pass, for the weight gradient.
at::Tensor act_linear(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  checks::linear_args(input, weight, bias, "act_linear");
  const Act a = parse_act(act);
  return at::linear(act_forward(input, a, act_param).to(weight.scalar_type()), weight, bias);
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
      const at::Tensor y = act_forward(input, a, act_param).to(weight.scalar_type());
      grad_weight = at::mm(g2.t(), y.reshape({-1, weight.size(1)}));
    }
    if (output_mask[2] && has_bias) grad_bias = g2.sum(0);
  }
  if (output_mask[0]) {
    const at::Tensor grad_y = at::matmul(grad_out, weight).to(input.scalar_type());
    grad_input = act_backward(grad_y, input, a, act_param);
  }
  return {grad_input, grad_weight, grad_bias};
}

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // F.linear(act(input), weight, bias) that keeps only input, weight and bias for backward.
  m.def(
      "act_linear(Tensor input, Tensor weight, Tensor? bias, str act, float act_param) "
      "-> Tensor");
  m.def(
      "act_linear_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "str act, float act_param, bool[3] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("act_linear", &act_linear);
  m.impl("act_linear_backward", &act_linear_backward);
}

}  // namespace fxfuse
