// Device-generic BatchNorm-apply + activation, written with ATen ops only.
// Registered as CompositeExplicitAutograd, so it serves every device without a dedicated
// kernel (and CPU under generic_path.h's switch); it is also the C++ reference for the
// CPU and CUDA kernels.
//
// Lean by construction: no call holds more activation-sized buffers than eager's
// F.batch_norm -> activation does for the same work (tests/test_generic_path.py measures it):
//  * bn_stats: batch_norm_update_stats (ATen's per-channel reduction, float accumulation
//    for half / bfloat16 without a float copy of the input);
//  * bn_act (and bn_act_ over its input): ATen's batch-norm apply with eager's training
//    coefficients (affine_into), written into the output, then the activation in place: one
//    activation-sized buffer, the output;
//  * bn_act_backward: two passes over memory, see backward(): the pre-activation's buffer,
//    which takes g, and the destination (none in the in-place forms, which write over the
//    input or grad_out); half / bfloat16 take ATen's backward for grad_input, as eager.
// Half / bfloat16 round z and g to the input dtype as eager does; ATen's kernels do
// their arithmetic and reductions in float.
#include <ATen/MemoryOverlap.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/add.h>
#include <ATen/ops/batch_norm_update_stats.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/native_batch_norm.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/var_mean.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <tuple>

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

// invstd = 1 / sqrt(var + eps) as eager's training batch_norm computes it on the device:
// on CPU in double, rounded once to the statistics dtype (ATen's InvStd<T> with its double
// epsilon), elsewhere in the statistics dtype (CUDA's InvStd<accscalar_t>); 0 where
// var + eps == 0, as InvStd gives. Eager's evaluation form (1 / sqrt(var + eps) in float on
// CPU) can differ in the last bit; like the CPU kernels, every call uses this one.
at::Tensor training_invstd(const at::Tensor& var, double eps) {
  const at::Tensor v = var.device().is_cpu() ? var.to(at::kDouble) : var;
  at::Tensor invstd = (v + eps).sqrt_().reciprocal_();
  if (eps == 0) invstd.masked_fill_(v == 0, 0);
  return invstd.to(var.scalar_type());
}

// out = (t - center) * scale + shift per channel (shift 0 when absent), through ATen's
// batch-norm apply in evaluation form with var 1 and eps 0 (its invstd 1 / sqrt(1) is
// exactly 1, so its coefficients are scale and shift - center * scale, as eager's
// training batch_norm forms them): one rounding to t's dtype, float arithmetic for half /
// bfloat16 with float coefficients and no float copy of t (CPU's elementwise ops copy
// mixed-dtype operands). `out` may be t (each element is read before it is written). The
// per-channel vectors are in the statistics dtype.
void affine_into(
    const at::Tensor& t, const at::Tensor& center, const at::Tensor& scale, const OptTensor& shift,
    at::Tensor& out) {
  if (!out.is_same(t) && out.strides() != t.strides()) {
    // ATen's CPU apply writes `out` in t's element order (wrong values under its DEFAULT
    // capability when the layouts differ): copy, then apply in place.
    out.copy_(t);
    affine_into(out, center, scale, shift, out);
    return;
  }
  const auto opts = scale.options();
  at::Tensor save_mean = at::empty({0}, opts), save_invstd = at::empty({0}, opts);
  at::native_batch_norm_out(
      out, save_mean, save_invstd, t, scale, shift, center, at::ones_like(scale),
      /*training=*/false, /*momentum=*/0.0, /*eps=*/0.0);
}

// act(batch_norm_apply(input)) into `out`, a tensor of the input's size: a fresh one, or
// the input itself (the apply reads each element before writing it, and the activation
// runs in place). mean, invstd, weight and bias are in the statistics dtype; eager's
// training batch_norm's z = x * alpha + beta (alpha = invstd * weight,
// beta = bias - mean * alpha) on CPU, bit for bit.
void forward_into(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const OptTensor& weight, const OptTensor& bias, Act a, double act_param, at::Tensor& out) {
  if (input.numel() == 0) return;  // ATen's kernels divide by the element count
  affine_into(input, mean, checks::given(weight) ? invstd * *weight : invstd, bias, out);
  act_forward_(out, a, act_param);
}

void forward_into(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const OptTensor& weight, const OptTensor& bias, double eps, Act a, double act_param,
    at::Tensor& out) {
  const auto sd = stats_dtype(input.scalar_type());
  forward_into(
      input, mean.to(sd), training_invstd(var.to(sd), eps), in_dtype(weight, sd), in_dtype(bias, sd), a,
      act_param, out);
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

// Where bn_act_backward's grad_input goes: a fresh tensor, over the input
// (bn_act_backward_) or over grad_out (bn_act_backward_into_grad_).
enum class Dest { Fresh, Input, GradOut };

// Contiguous or channels_last: ATen's batch-norm apply takes other kernels (other bits) for
// other strides, so the backward writes over such tensors only.
bool dense(const at::Tensor& t) {
  return t.is_contiguous() || t.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// bn_act_backward in two passes over memory, each no larger than eager's:
//  1. g = dy * act'(z) (z recomputed), written over z's buffer or over grad_out, and its
//     per-channel sums sum(g) and sum(g * xhat) by native_batch_norm_backward without
//     grad_input (ATen's reduction: eager's grad_weight and grad_bias for eager's g,
//     no activation-sized temporary);
//  2. grad_input = (g + u) * invstd * weight, u = -(x - mean) * k - mean(g),
//     k = mean(g * xhat) * invstd (eager's formula, regrouped), in elementwise passes over
//     the destination (x - mean; u; g + u, then the scale in place); float32 / float64 only.
// Peak: z's buffer and the destination (eager: g, grad_input and the temporary its
// native_batch_norm_backward allocates); the in-place forms need z's buffer only.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const OptTensor& weight, const OptTensor& bias, double eps, Act a,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask, Dest dest) {
  const bool need_input = output_mask[0];
  const bool need_weight = output_mask[1] && checks::given(weight);
  const bool need_bias = output_mask[2] && checks::given(bias);
  if (!need_input && !need_weight && !need_bias) return {};
  if (input.numel() == 0) {  // sums over no element (ATen's kernels divide by the count)
    return {need_input && dest == Dest::Fresh ? at::empty_like(input) : at::Tensor(),
            need_weight ? at::zeros_like(*weight) : at::Tensor(),
            need_bias ? at::zeros_like(*bias) : at::Tensor()};
  }
  const auto sd = stats_dtype(input.scalar_type());
  const at::Tensor m = mean.to(sd), invstd = training_invstd(var.to(sd), eps);
  const OptTensor w = in_dtype(weight, sd), b = in_dtype(bias, sd);
  // Where grad_input is computed: over the input or grad_out, unless their dtype or strides
  // would change the bits; then in a fresh tensor, copied over them at the end.
  const bool over_input = dest == Dest::Input && dense(input);
  const bool over_grad_out = dest == Dest::GradOut && dense(input) && !grad_out.is_same(input) &&
      grad_out.scalar_type() == input.scalar_type() && grad_out.strides() == input.strides();

  // Half / bfloat16 take grad_input from ATen's backward (below), the others step 2.
  const bool two_pass = !at::isReducedFloatingType(input.scalar_type());
  // g, in the input dtype: over grad_out when it is the destination or a converted copy, over
  // z's buffer when grad_out has the input's strides, else where ATen's activation backward
  // puts it (eager's g: some follow the gradient's strides, some z's), as
  // native_batch_norm_backward's reduction takes its path, and its bits, from them
  // (channels_last: float sums; mixed layouts: double). `spare` keeps z's buffer for u when g
  // lies in the destination.
  at::Tensor g = grad_out.to(input.scalar_type()), spare;
  if (a != Act::None) {
    at::Tensor z = at::empty_like(input);
    forward_into(input, m, invstd, w, b, Act::None, 0.0, z);
    if (over_grad_out || !g.is_same(grad_out) || g.strides() == z.strides()) {
      at::Tensor dst = over_grad_out || !g.is_same(grad_out) ? g : z;
      act_backward_into(dst, g, z, a, act_param);
      g = dst;
    } else {
      g = act_backward(g, z, a, act_param);
    }
    if (over_grad_out && batch_stats && two_pass) spare = z;
  }  // z is freed here unless it holds g or is spare
  const bool need_sums = need_weight || need_bias || (need_input && batch_stats);
  at::Tensor grad_input, sum_gxhat, sum_g;
  if (need_input && batch_stats && !two_pass) {
    // Half / bfloat16: each pass of step 2 would round to the input dtype; ATen's backward
    // rounds grad_input once, from float arithmetic (eager's bits), and holds g, grad_input
    // and one temporary, as eager's does.
    std::tie(grad_input, sum_gxhat, sum_g) = at::native_batch_norm_backward(
        g, input, w, std::nullopt, std::nullopt, m, invstd, /*train=*/true, eps, {true, true, true});
  } else if (need_sums) {
    std::tie(std::ignore, sum_gxhat, sum_g) = at::native_batch_norm_backward(
        g, input, w, std::nullopt, std::nullopt, m, invstd, /*train=*/true, eps, {false, true, true});
  }
  if (need_input && !grad_input.defined()) {
    grad_input = over_input ? input : over_grad_out ? grad_out : at::empty_like(input);
    const at::Tensor scale = w ? invstd * *w : invstd;
    const at::Tensor zero = at::zeros_like(m);
    if (batch_stats) {
      const double M = static_cast<double>(input.numel() / input.size(1));
      const at::Tensor neg_k = sum_gxhat * invstd / -M, neg_mean_g = sum_g / -M;
      // u over the destination, or over a spare buffer when g is there
      at::Tensor u = over_grad_out ? (spare.defined() ? spare : at::empty_like(input)) : grad_input;
      at::sub_out(u, input, m.reshape({1, -1, 1, 1}));
      affine_into(u, zero, neg_k, neg_mean_g, u);
      at::add_out(grad_input, g, u);
      affine_into(grad_input, zero, scale, std::nullopt, grad_input);
    } else {
      affine_into(g, zero, scale, std::nullopt, grad_input);
    }
  }
  if (need_input && dest == Dest::Input && !grad_input.is_same(input)) input.copy_(grad_input);
  if (need_input && dest == Dest::GradOut && !grad_input.is_same(grad_out)) grad_out.copy_(grad_input);
  return {grad_input, need_weight ? sum_gxhat.to(weight->scalar_type()) : at::Tensor(),
          need_bias ? sum_g.to(bias->scalar_type()) : at::Tensor()};
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
      output_mask, Dest::Fresh);
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
      {true, output_mask[0], output_mask[1]}, Dest::Input);
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
      {true, output_mask[0], output_mask[1]}, Dest::GradOut);
  return {grad_weight, grad_bias};
}

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

namespace schemas {
const char* const kBnStats =
    "bn_stats(Tensor input) -> (Tensor mean, Tensor var, Tensor unbiased_var)";
const char* const kBnAct =
    "bn_act(Tensor input, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, "
    "float eps, str act, float act_param) -> Tensor";
const char* const kBnActBackward =
    "bn_act_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor var, "
    "Tensor? weight, Tensor? bias, float eps, str act, float act_param, "
    "bool batch_stats, bool[3] output_mask) -> (Tensor, Tensor, Tensor)";
const char* const kBnActInplace =
    "bn_act_(Tensor(a!) self, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, "
    "float eps, str act, float act_param) -> ()";
const char* const kBnActBackwardInplace =
    "bn_act_backward_(Tensor grad_out, Tensor(a!) input, Tensor mean, Tensor var, "
    "Tensor? weight, Tensor? bias, float eps, str act, float act_param, "
    "bool batch_stats, bool[2] output_mask) -> (Tensor grad_weight, Tensor grad_bias)";
const char* const kBnActBackwardIntoGrad =
    "bn_act_backward_into_grad_(Tensor(a!) grad_out, Tensor input, Tensor mean, Tensor var, "
    "Tensor? weight, Tensor? bias, float eps, str act, float act_param, "
    "bool batch_stats, bool[2] output_mask) -> (Tensor grad_weight, Tensor grad_bias)";
}  // namespace schemas

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // Per-channel batch statistics of a 4-D tensor: mean, biased var (which the BN applies)
  // and unbiased var (for the running statistics). On CPU, eager batch_norm's bits.
  m.def(schemas::kBnStats);
  // act(batch_norm_apply(input)) with the given statistics.
  m.def(schemas::kBnAct);
  m.def(schemas::kBnActBackward);
  // In-place forms for composites that own the tensor: bn_act_ overwrites self with
  // bn_act(self, ...); bn_act_backward_ overwrites input with grad_input and returns
  // the parameter gradients (output_mask: weight, bias); bn_act_backward_into_grad_
  // overwrites grad_out with grad_input instead. Same numerics as above.
  m.def(schemas::kBnActInplace);
  m.def(schemas::kBnActBackwardInplace);
  m.def(schemas::kBnActBackwardIntoGrad);
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("bn_stats", &bn_stats_generic);
  m.impl("bn_act", &bn_act_generic);
  m.impl("bn_act_backward", &bn_act_backward_generic);
  m.impl("bn_act_", &bn_act_generic_);
  m.impl("bn_act_backward_", &bn_act_backward_generic_);
  m.impl("bn_act_backward_into_grad_", &bn_act_backward_into_grad_generic_);
}

}  // namespace fxfuse
