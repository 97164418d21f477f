// Device-generic BatchNorm-apply + activation, written with ATen ops only.
// Registered as CompositeExplicitAutograd, so it serves CUDA and every device
// without a dedicated kernel; it is also the C++ reference for the CPU kernels.
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/var_mean.h>
#include <torch/library.h>

#include "../activation_ops.h"
#include "../bn_act.h"
#include "../checks.h"
#include "../dispatch.h"

namespace fxfuse {

at::ScalarType stats_dtype(at::ScalarType t) {
  return at::isReducedFloatingType(t) ? at::kFloat : t;
}

at::MemoryFormat suggested_format(const at::Tensor& t) {
  return t.suggest_memory_format();
}

namespace {

// View a per-channel vector as (1, C, 1, 1) for broadcasting.
at::Tensor per_channel(const at::Tensor& v) { return v.view({1, -1, 1, 1}); }

// Per-channel (invstd, scale) such that bn(x) = (x - mean) * scale + bias. Subtracting the
// mean first (rather than x * scale + shift) avoids cancellation when |mean| >> std.
std::tuple<at::Tensor, at::Tensor> inv_scale(
    const at::Tensor& var, const std::optional<at::Tensor>& weight, double eps, at::ScalarType sd) {
  at::Tensor invstd = (var.to(sd) + eps).rsqrt();
  at::Tensor scale = weight.has_value() && weight->defined() ? invstd * weight->to(sd) : invstd;
  return {invstd, scale};
}

at::Tensor normalize(
    const at::Tensor& x, const at::Tensor& mean, const at::Tensor& scale,
    const std::optional<at::Tensor>& bias, at::ScalarType sd) {
  at::Tensor z = (x - per_channel(mean.to(sd))) * per_channel(scale);
  if (bias.has_value() && bias->defined()) z = z + per_channel(bias->to(sd));
  return z;
}

// Give `result` the layout at::empty_like(like) has, as the fake kernels promise.
at::Tensor match_layout(const at::Tensor& result, const at::Tensor& like, at::ScalarType dtype) {
  if (result.scalar_type() == dtype && result.strides() == like.strides()) return result;
  at::Tensor out = at::empty_like(like, like.options().dtype(dtype));
  out.copy_(result);
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_generic(const at::Tensor& input) {
  checks::bn_input(input, "bn_stats");
  auto sd = stats_dtype(input.scalar_type());
  auto [var, mean] = at::var_mean(input.to(sd), {0, 2, 3}, /*correction=*/0, /*keepdim=*/false);
  const double m = input.size(1) ? static_cast<double>(input.numel() / input.size(1)) : 0.0;
  return {mean, var, var * (m / (m - 1))};
}

at::Tensor bn_act_generic(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  checks::bn_input(input, "bn_act");
  Act a = parse_act(act);
  auto sd = stats_dtype(input.scalar_type());
  auto [invstd, scale] = inv_scale(var, weight, eps, sd);
  at::Tensor z = normalize(input.to(sd), mean, scale, bias, sd);
  // Half / bfloat16 input: eager's batch_norm rounds z to the input dtype and the
  // activation runs on that (a no-op cast for float / double).
  z = z.to(input.scalar_type());
  return match_layout(act_forward(z, a, act_param), input, input.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_generic(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask) {
  checks::bn_input(input, "bn_act_backward");
  Act a = parse_act(act);
  auto sd = stats_dtype(input.scalar_type());
  auto [invstd, scale] = inv_scale(var, weight, eps, sd);
  at::Tensor x = input.to(sd);
  at::Tensor g = grad_out.to(sd);
  if (a != Act::None) {
    // The activation's backward in the input dtype, on z rounded to it, as eager runs
    // it for half / bfloat16 (no-op casts for float / double).
    const auto t = input.scalar_type();
    g = act_backward(grad_out.to(t), normalize(x, mean, scale, bias, sd).to(t), a, act_param)
            .to(sd);
  }

  const bool need_sums = output_mask[1] || output_mask[2] || (output_mask[0] && batch_stats);
  at::Tensor xhat, sum_g, sum_gx;
  if (need_sums) {
    xhat = (x - per_channel(mean.to(sd))) * per_channel(invstd);
    sum_g = g.sum({0, 2, 3});
    sum_gx = (g * xhat).sum({0, 2, 3});
  }
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    at::Tensor gi;
    if (batch_stats) {
      const double m = static_cast<double>(input.numel() / input.size(1));
      gi = (g - per_channel(sum_g / m) - xhat * per_channel(sum_gx / m)) * per_channel(scale);
    } else {
      gi = g * per_channel(scale);
    }
    grad_input = match_layout(gi, input, input.scalar_type());
  }
  const bool has_weight = weight.has_value() && weight->defined();
  const bool has_bias = bias.has_value() && bias->defined();
  if (output_mask[1] && has_weight) grad_weight = sum_gx.to(weight->scalar_type());
  if (output_mask[2] && has_bias) grad_bias = sum_g.to(bias->scalar_type());
  return {grad_input, grad_weight, grad_bias};
}

// The generic in-place forms compute out of place and copy: they exist so that the
// composites can call one op on every device; the CPU kernels work truly in place.
void bn_act_generic_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  self.copy_(bn_act_generic(self, mean, var, weight, bias, eps, act, act_param));
}

namespace {

// bn_act_backward with grad_input copied over `dst` (the input or grad_out); returns the
// parameter gradients.
std::tuple<at::Tensor, at::Tensor> backward_copied_over(
    const at::Tensor& dst, const at::Tensor& grad_out, const at::Tensor& input,
    const at::Tensor& mean, const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act, double act_param,
    bool batch_stats, std::array<bool, 2> output_mask) {
  auto [grad_input, grad_weight, grad_bias] = bn_act_backward_generic(
      grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
      {true, output_mask[0], output_mask[1]});
  dst.copy_(grad_input);
  return {grad_weight, grad_bias};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> bn_act_backward_generic_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  return backward_copied_over(
      input, grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
      output_mask);
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_generic_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  return backward_copied_over(
      grad_out, grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
      output_mask);
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_act(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool batch_stats, double eps,
    c10::string_view act, double act_param) {
  checks::bn_input(input, "batch_norm_act");
  auto [mean, var, unbiased_var] =
      normalization_stats(input, running_mean, running_var, batch_stats, "batch_norm_act");
  at::Tensor out = dispatch::bn_act(input, mean, var, weight, bias, eps, act, act_param);
  return {out, mean, var, unbiased_var};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> normalization_stats(
    const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool batch_stats, const char* op) {
  if (batch_stats) return dispatch::bn_stats(input);
  TORCH_CHECK(
      running_mean.has_value() && running_mean->defined() && running_var.has_value() &&
          running_var->defined(),
      "fxfuse::", op, ": running_mean and running_var must be defined when batch_stats is false");
  auto sd = stats_dtype(input.scalar_type());
  at::Tensor var = running_var->to(sd, /*non_blocking=*/false, /*copy=*/true);
  return {running_mean->to(sd, /*non_blocking=*/false, /*copy=*/true), var, var.clone()};
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("bn_stats", &bn_stats_generic);
  m.impl("bn_act", &bn_act_generic);
  m.impl("bn_act_backward", &bn_act_backward_generic);
  m.impl("bn_act_", &bn_act_generic_);
  m.impl("bn_act_backward_", &bn_act_backward_generic_);
  m.impl("bn_act_backward_into_grad_", &bn_act_backward_into_grad_generic_);
  m.impl("batch_norm_act", &batch_norm_act);
}

}  // namespace fxfuse
