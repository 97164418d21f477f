// F.linear(F.layer_norm(input, ...), weight, bias) that keeps only the layer norm's input
// (and the parameters) for backward. Eager keeps the layer norm's input for its own
// backward and its output for the linear's weight gradient; in a transformer block or a
// ConvNeXt block (LayerNorm -> Linear) both are as wide as the model. The backward op runs
// the layer norm again (one pass over its input, which also gives back the mean and rstd
// eager would have kept), takes the linear's gradients, then the layer norm's backward.
// No matmul runs twice.
//
// Forward and backward are the ATen calls eager makes (F.layer_norm is
// at::native_layer_norm's first output), so the output is eager's bit for bit. Built from
// ATen calls only and registered as CompositeExplicitAutograd: one implementation for
// every device.
//
// The linear runs in the weight's dtype: a layer norm output of another dtype is cast to it, as
// torch.autocast casts F.linear's input (the op's Autocast kernel passes the cast weight and the
// layer norm's operands as autocast leaves or casts them for layer_norm). The backward casts the
// linear's input gradient back, as autograd does through eager's cast.
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/native_layer_norm.h>
#include <ATen/ops/native_layer_norm_backward.h>
#include <torch/library.h>

#include <array>
#include <tuple>

#include "../checks.h"
#include "../norm_ops.h"

namespace fxfuse {
namespace {

// A layer norm over the input's last dimension, then F.linear's operands (checks::linear_args).
void check_args(
    const at::Tensor& input, at::IntArrayRef normalized_shape, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(
      normalized_shape.size() == 1, "fxfuse::", op,
      ": expected a layer norm over the last dimension (normalized_shape of one size), got ",
      normalized_shape);
  TORCH_CHECK(
      input.dim() >= 1 && input.size(-1) == normalized_shape[0], "fxfuse::", op,
      ": expected an input whose last dimension is normalized_shape[0] = ", normalized_shape[0],
      ", got input of shape ", input.sizes());
  checks::linear_args(input, weight, bias, op);
}

}  // namespace

at::Tensor layer_norm_linear(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
    double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_args(input, normalized_shape, weight, bias, "layer_norm_linear");
  const at::Tensor y =
      std::get<0>(at::native_layer_norm(input, normalized_shape, ln_weight, ln_bias, eps));
  return at::linear(y.to(weight.scalar_type()), weight, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_linear_backward(
    const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
    double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 5> output_mask) {
  check_args(input, normalized_shape, weight, bias, "layer_norm_linear_backward");
  const bool ln_grads = output_mask[0] || (output_mask[1] && checks::given(ln_weight)) ||
      (output_mask[2] && checks::given(ln_bias));
  const bool weight_grad = output_mask[3];
  const bool bias_grad = output_mask[4] && checks::given(bias);
  at::Tensor grad_input, grad_ln_weight, grad_ln_bias, grad_weight, grad_bias;
  if (!(ln_grads || weight_grad || bias_grad)) {
    return {grad_input, grad_ln_weight, grad_ln_bias, grad_weight, grad_bias};
  }
  const at::Tensor g2 = grad_out.reshape({-1, weight.size(0)});
  if (bias_grad) grad_bias = g2.sum(0);
  if (!(ln_grads || weight_grad)) {
    return {grad_input, grad_ln_weight, grad_ln_bias, grad_weight, grad_bias};
  }
  // The one tensor this op did not keep, with the statistics eager kept next to it.
  auto [y, mean, rstd] = at::native_layer_norm(input, normalized_shape, ln_weight, ln_bias, eps);
  if (weight_grad) {
    grad_weight = at::mm(g2.t(), y.to(weight.scalar_type()).reshape({-1, weight.size(1)}));
  }
  if (ln_grads) {
    const auto norm_dtype = y.scalar_type();
    y.reset();  // free the recomputed output before the layer norm's backward allocates
    std::tie(grad_input, grad_ln_weight, grad_ln_bias) = at::native_layer_norm_backward(
        at::matmul(grad_out, weight).to(norm_dtype), input, normalized_shape, mean, rstd, ln_weight, ln_bias,
        {output_mask[0], output_mask[1] && checks::given(ln_weight),
         output_mask[2] && checks::given(ln_bias)});
  }
  return {grad_input, grad_ln_weight, grad_ln_bias, grad_weight, grad_bias};
}

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // F.linear(F.layer_norm(input, normalized_shape, ln_weight, ln_bias, eps), weight, bias)
  // that keeps only input and the parameters for backward.
  m.def(
      "layer_norm_linear(Tensor input, int[] normalized_shape, Tensor? ln_weight, "
      "Tensor? ln_bias, float eps, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "layer_norm_linear_backward(Tensor grad_out, Tensor input, int[] normalized_shape, "
      "Tensor? ln_weight, Tensor? ln_bias, float eps, Tensor weight, Tensor? bias, "
      "bool[5] output_mask) -> (Tensor grad_input, Tensor grad_ln_weight, Tensor grad_ln_bias, "
      "Tensor grad_weight, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("layer_norm_linear", &layer_norm_linear);
  m.impl("layer_norm_linear_backward", &layer_norm_linear_backward);
}

}  // namespace fxfuse
