// Device-generic BatchNorm-apply + activation, written with ATen ops only.
// Registered as CompositeExplicitAutograd, so it serves every device without a dedicated
// kernel (and CPU under generic_path.h's switch); it is also the C++ reference for the
// CPU and CUDA kernels.
//
// Lean by construction: each op is ATen's own fused batch-norm kernels plus the
// activation, in the order eager runs them, so no call holds more activation-sized
// temporaries than eager's F.batch_norm -> activation does:
//  * bn_stats: batch_norm_update_stats (ATen's per-channel reduction, float accumulation
//    for half / bfloat16 without a float copy of the input);
//  * bn_act (and bn_act_ over its input): native_batch_norm in evaluation form with the
//    given statistics as the running ones, written into the output, then the activation in
//    place: one activation-sized buffer, the output;
//  * bn_act_backward: the pre-activation z (one buffer), the activation's backward g written
//    over z (or over grad_out in bn_act_backward_into_grad_), then
//    native_batch_norm_backward from g: eager's g and grad_input at most. The in-place forms
//    copy grad_input over their destination.
// Half / bfloat16 round z and g to the input dtype as eager does; ATen's kernels do
// their arithmetic and reductions in float.
#include <ATen/MemoryOverlap.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/batch_norm_update_stats.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/native_batch_norm.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/var_mean.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
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

using OptTensor = std::optional<at::Tensor>;

// A per-channel vector in the statistics dtype `sd`, which ATen's batch-norm kernels
// require of every parameter of a half / bfloat16 input (a no-op in the usual case).
OptTensor in_dtype(const OptTensor& t, at::ScalarType sd) {
  return checks::given(t) ? OptTensor(t->to(sd)) : std::nullopt;
}

// act(batch_norm_apply(input)) into `out`, a tensor of the input's size: a fresh one, or
// the input itself (the apply reads each element before writing it, and the activation
// runs in place).
void forward_into(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const OptTensor& weight, const OptTensor& bias, double eps, Act a, double act_param,
    at::Tensor& out) {
  if (input.numel() == 0) return;  // ATen's kernels divide by the element count
  const auto sd = stats_dtype(input.scalar_type());
  const auto opts = input.options().dtype(sd);
  at::Tensor save_mean = at::empty({0}, opts), save_invstd = at::empty({0}, opts);
  at::native_batch_norm_out(
      out, save_mean, save_invstd, input, in_dtype(weight, sd), in_dtype(bias, sd), mean.to(sd),
      var.to(sd), /*training=*/false, /*momentum=*/0.0, eps);
  act_forward_(out, a, act_param);
}

// Give `result` the layout at::empty_like(like) has, as the fake kernels promise.
at::Tensor match_layout(const at::Tensor& result, const at::Tensor& like) {
  if (result.scalar_type() == like.scalar_type() && result.strides() == like.strides()) return result;
  at::Tensor out = at::empty_like(like);
  out.copy_(result);
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_generic(const at::Tensor& input) {
  checks::bn_input(input, "bn_stats");
  const auto sd = stats_dtype(input.scalar_type());
  if (input.numel() == 0) {  // NaN statistics, as eager's (ATen's reduction rejects it)
    auto [var, mean] = at::var_mean(input.to(sd), {0, 2, 3}, /*correction=*/0, /*keepdim=*/false);
    return {mean, var, var.clone()};
  }
  // With momentum 1 the running-statistics update becomes a copy, rounded as eager rounds
  // it, of the unbiased variance (1 * v + 0 * 0) into the zero buffer.
  const auto opts = input.options().dtype(sd);
  at::Tensor running_mean = at::zeros({input.size(1)}, opts);
  at::Tensor unbiased = at::zeros({input.size(1)}, opts);
  auto [mean, var] = at::batch_norm_update_stats(input, running_mean, unbiased, 1.0);
  return {mean, var, unbiased};
}

at::Tensor bn_act_generic(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act");
  const Act a = parse_act(act);
  at::Tensor out = at::empty_like(input);
  forward_into(input, mean, var, weight, bias, eps, a, act_param, out);
  return out;
}

namespace {

// bn_act_backward's gradients. g (the activation's backward) goes over the pre-activation
// z's buffer, or over grad_out itself when `g_over_grad_out` (grad_out is the caller's to
// overwrite, in the input's dtype): one activation-sized buffer fewer than eager's g.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const OptTensor& weight, const OptTensor& bias, double eps, Act a,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask, bool g_over_grad_out) {
  const bool need_weight = output_mask[1] && checks::given(weight);
  const bool need_bias = output_mask[2] && checks::given(bias);
  if (!output_mask[0] && !need_weight && !need_bias) return {};
  const auto sd = stats_dtype(input.scalar_type());
  if (input.numel() == 0) {  // sums over no element (ATen's kernels divide by the count)
    return {output_mask[0] ? at::empty_like(input) : at::Tensor(),
            need_weight ? at::zeros_like(*weight) : at::Tensor(),
            need_bias ? at::zeros_like(*bias) : at::Tensor()};
  }
  // g = dy * act'(z): the gradient reaching batch norm's output, in the input dtype.
  at::Tensor g = grad_out.to(input.scalar_type());
  if (a != Act::None) {
    at::Tensor z = at::empty_like(input);
    forward_into(input, mean, var, weight, bias, eps, Act::None, 0.0, z);
    at::Tensor dst = g_over_grad_out ? g : z;
    act_backward_into(dst, g, z, a, act_param);
    g = dst;
  }  // z is freed here unless it holds g
  const at::Tensor m = mean.to(sd), v = var.to(sd);
  const at::Tensor invstd = (v + eps).rsqrt();
  auto [grad_input, grad_weight, grad_bias] = at::native_batch_norm_backward(
      g, input, in_dtype(weight, sd), m, v, m, invstd, batch_stats, eps,
      {output_mask[0], need_weight, need_bias});
  g.reset();
  if (grad_input.defined()) grad_input = match_layout(grad_input, input);
  grad_weight = need_weight ? grad_weight.to(weight->scalar_type()) : at::Tensor();
  grad_bias = need_bias ? grad_bias.to(bias->scalar_type()) : at::Tensor();
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_generic(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward");
  return backward(
      grad_out, input, mean, var, weight, bias, eps, parse_act(act), act_param, batch_stats,
      output_mask, /*g_over_grad_out=*/false);
}

void bn_act_generic_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  checks::bn_args(self, mean, var, weight, bias, "bn_act_");
  const Act a = parse_act(act);
  if (!self.is_contiguous() && !self.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    // ATen applies batch norm to a strided view with other kernels than to bn_act's dense
    // output; computing out of place keeps bn_act's bits (such inputs are rare).
    self.copy_(bn_act_generic(self, mean, var, weight, bias, eps, act, act_param));
    return;
  }
  at::Tensor out = self;
  forward_into(self, mean, var, weight, bias, eps, a, act_param, out);
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_generic_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward_");
  auto [grad_input, grad_weight, grad_bias] = backward(
      grad_out, input, mean, var, weight, bias, eps, parse_act(act), act_param, batch_stats,
      {true, output_mask[0], output_mask[1]}, /*g_over_grad_out=*/false);
  input.copy_(grad_input);
  return {grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_generic_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward_into_grad_");
  at::assert_no_partial_overlap(grad_out, input);
  auto [grad_input, grad_weight, grad_bias] = backward(
      grad_out, input, mean, var, weight, bias, eps, parse_act(act), act_param, batch_stats,
      {true, output_mask[0], output_mask[1]},
      /*g_over_grad_out=*/grad_out.scalar_type() == input.scalar_type() && !grad_out.is_same(input));
  grad_out.copy_(grad_input);
  return {grad_weight, grad_bias};
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
