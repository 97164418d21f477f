// The input checks every implementation of the batch-norm + activation ops makes (generic,
// CPU, elementwise/CUDA), with one wording: the message names the op and what was expected.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fxfuse::checks {

// An optional tensor argument that was passed (a Tensor? given as None is not).
inline bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// A 4-D (N, C, H, W) floating-point input.
inline void bn_input(const at::Tensor& input, const char* op) {
  TORCH_CHECK(
      input.dim() == 4, "fxfuse::", op, ": expected a 4-D (N, C, H, W) input, got ", input.dim(),
      "-D");
  TORCH_CHECK(
      at::isFloatingType(input.scalar_type()), "fxfuse::", op,
      ": expected a floating-point input, got ", input.scalar_type());
}

// bn_input, and per-channel vectors (mean, var, and weight and bias when given) on the
// input's device with one element per channel.
inline void bn_args(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const char* op) {
  bn_input(input, op);
  const int64_t C = input.size(1);
  auto check = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.defined(), "fxfuse::", op, ": ", name, " must be defined");
    TORCH_CHECK(
        t.device() == input.device(), "fxfuse::", op, ": expected ", name, " on ",
        input.device(), ", got ", t.device());
    TORCH_CHECK(
        t.numel() == C, "fxfuse::", op, ": expected ", name, " to have ", C,
        " elements (one per channel of the input), got shape ", t.sizes());
  };
  check(mean, "mean");
  check(var, "var");
  if (given(weight)) check(*weight, "weight");
  if (given(bias)) check(*bias, "bias");
}

// F.linear's operands: an input with at least one dimension whose last one is in_features, a
// 2-D (out_features, in_features) weight, and a bias of out_features elements when given.
inline void linear_args(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const char* op) {
  TORCH_CHECK(
      input.dim() >= 1, "fxfuse::", op, ": expected an input with at least 1 dimension, got a ",
      "0-D tensor");
  TORCH_CHECK(
      weight.dim() == 2, "fxfuse::", op,
      ": expected a 2-D weight of shape (out_features, in_features), got shape ",
      weight.sizes());
  TORCH_CHECK(
      input.size(-1) == weight.size(1), "fxfuse::", op,
      ": expected the input's last dimension to equal in_features = weight.size(1) = ",
      weight.size(1), ", got input of shape ", input.sizes());
  if (given(bias)) {
    TORCH_CHECK(
        bias->dim() == 1 && bias->size(0) == weight.size(0), "fxfuse::", op,
        ": expected a bias of shape [", weight.size(0), "] (out_features), got shape ",
        bias->sizes());
  }
}

}  // namespace fxfuse::checks
