// The host logic of the BatchNorm + activation kernels, shared by the CUDA build
// (cuda/*.cu) and the host build (cpu/bn_act_elementwise.cpp): argument checks, layouts,
// the per-channel tensors' dtype, allocations, and the op kernels (bn_stats, bn_act,
// bn_act_backward and their in-place forms, update_running_stats_) written once over a
// build's Kernels (bn_act_kernels.h). In the usual case it issues no ATen op but
// allocations (tests/test_bn_act_elementwise.py counts them in the host build): every
// per-channel computation runs inside the kernels.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <optional>
#include <tuple>

#include "activation_ops.h"
#include "bn_act.h"
#include "bn_act_device.h"
#include "bn_act_elementwise.h"
#include "bn_act_kernels.h"
#include "checks.h"

namespace fxfuse::elementwise {

// The layout of `t` if the kernels handle it (contiguous NCHW or channels_last).
inline std::optional<std::pair<Layout, at::MemoryFormat>> layout_of(const at::Tensor& t) {
  const Layout base{t.size(0), t.size(1), t.size(2) * t.size(3), false};
  if (t.is_contiguous()) return std::make_pair(base, at::MemoryFormat::Contiguous);
  if (t.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    Layout cl = base;
    cl.channels_last = true;
    return std::make_pair(cl, at::MemoryFormat::ChannelsLast);
  }
  return std::nullopt;
}

// t in dtype sd, contiguous: t itself (no op) when it already is.
inline at::Tensor in_dtype(const at::Tensor& t, at::ScalarType sd) {
  at::Tensor r = t.scalar_type() == sd ? t : t.to(sd);
  return r.is_contiguous() ? r : r.contiguous();
}

inline at::Tensor in_dtype(const std::optional<at::Tensor>& t, at::ScalarType sd) {
  return checks::given(t) ? in_dtype(*t, sd) : at::Tensor();
}

// The per-channel tensors a kernel reads, in A, and the pointers it gets.
template <typename A>
struct HeldParams {
  at::Tensor mean, spread, weight, bias;
  ChannelParams<A> params;

  HeldParams(
      const at::Tensor& input, const at::Tensor& mean_, const at::Tensor& spread_,
      bool spread_is_var, const std::optional<at::Tensor>& weight_,
      const std::optional<at::Tensor>& bias_, double eps) {
    const auto sd = stats_dtype(input.scalar_type());
    mean = in_dtype(mean_, sd);
    spread = in_dtype(spread_, sd);
    weight = in_dtype(weight_, sd);
    bias = in_dtype(bias_, sd);
    params = {
        mean.const_data_ptr<A>(), spread.const_data_ptr<A>(),
        weight.defined() ? weight.const_data_ptr<A>() : nullptr,
        bias.defined() ? bias.const_data_ptr<A>() : nullptr, static_cast<A>(eps), spread_is_var};
  }
};

// A parameter's gradient buffer in A where it is asked for, and the result in the
// parameter's dtype.
inline at::Tensor grad_buffer(
    const std::optional<at::Tensor>& param, bool need, const at::TensorOptions& acc, int64_t C) {
  return need && checks::given(param) ? at::empty({C}, acc) : at::Tensor();
}

inline at::Tensor in_param_dtype(const at::Tensor& g, const std::optional<at::Tensor>& param) {
  return g.defined() && g.scalar_type() != param->scalar_type() ? g.to(param->scalar_type()) : g;
}

// The running statistics the finalize updates: both or neither, C-vectors on the input's
// device, contiguous, one dtype, A or the input's.
inline void check_running(
    const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var) {
  const bool m = checks::given(running_mean), v = checks::given(running_var);
  TORCH_CHECK(m == v, "fxfuse::bn_stats_update: running_mean and running_var must both be given or neither");
  if (!m) return;
  const auto sd = stats_dtype(input.scalar_type());
  for (const at::Tensor* t : {&*running_mean, &*running_var}) {
    TORCH_CHECK(
        t->dim() == 1 && t->numel() == input.size(1) && t->is_contiguous() &&
            t->device() == input.device() && t->scalar_type() == running_mean->scalar_type() &&
            (t->scalar_type() == sd || t->scalar_type() == input.scalar_type()),
        "fxfuse::bn_stats_update: expected contiguous running statistics of ", input.size(1),
        " channels on ", input.device(), " in ", sd, " or ", input.scalar_type());
  }
}

// grad_out in the input's dtype and layout: grad_out itself (no op) when it already is.
inline at::Tensor dy_like(const at::Tensor& grad_out, const at::Tensor& input) {
  const auto fmt = input.suggest_memory_format();
  if (grad_out.scalar_type() == input.scalar_type() && grad_out.is_contiguous(fmt)) return grad_out;
  return grad_out.to(input.scalar_type()).contiguous(fmt);
}

// Whether the backward kernels take this call: a layout they index, a non-empty input, and
// a grad_out of the input's sizes on its device.
inline std::optional<Layout> backward_layout(const at::Tensor& grad_out, const at::Tensor& input) {
  const auto layout = layout_of(input);
  if (!layout || input.numel() == 0 || !grad_out.defined() ||
      grad_out.device() != input.device() || grad_out.sizes() != input.sizes()) {
    return std::nullopt;
  }
  return layout->first;
}

[[noreturn]] inline void unsupported(const char* op) {
  TORCH_CHECK(false, "fxfuse::", op, ": expected a non-empty contiguous or channels_last input");
}

// ---- the op kernels, over a build's Kernels K ----

template <typename K>
BatchStats stats_update(
    const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps) {
  checks::bn_input(input, "bn_stats_update");
  check_running(input, running_mean, running_var);
  const auto layout = layout_of(input);
  if (!layout || input.numel() == 0) unsupported("bn_stats_update");
  return K::stats(input, layout->first, running_mean, running_var, momentum, eps, true);
}

template <typename K>
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_op(const at::Tensor& input) {
  checks::bn_input(input, "bn_stats");
  const auto layout = layout_of(input);
  if (!layout || input.numel() == 0) {
    if constexpr (K::kGenericFallback) return bn_stats_generic(input);
    unsupported("bn_stats");
  }
  BatchStats s = K::stats(input, layout->first, std::nullopt, std::nullopt, 0.0, 0.0, false);
  return {s.mean, s.var, s.unbiased_var};
}

template <typename K>
void update_running_stats_op(
    at::Tensor& running_mean, at::Tensor& running_var, const at::Tensor& mean,
    const at::Tensor& unbiased_var, double momentum) {
  const auto C = running_mean.numel();
  const bool kernel = running_mean.dim() == 1 && running_var.sizes() == running_mean.sizes() &&
      mean.numel() == C && unbiased_var.numel() == C && running_mean.is_contiguous() &&
      running_var.is_contiguous() && running_var.scalar_type() == running_mean.scalar_type() &&
      mean.device() == running_mean.device() && unbiased_var.device() == running_mean.device() &&
      running_var.device() == running_mean.device() && C > 0;
  if (!kernel) {
    if constexpr (K::kGenericFallback) {
      update_running_stats_generic_(running_mean, running_var, mean, unbiased_var, momentum);
      return;
    }
    TORCH_CHECK(false, "fxfuse::update_running_stats_: expected contiguous C-vectors on one device");
  }
  K::update_running_stats(running_mean, running_var, mean, unbiased_var, momentum);
}

template <typename K>
at::Tensor bn_act_op(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    c10::string_view act, double act_param) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act");
  const Act a = parse_act(act);
  const auto layout = layout_of(input);
  if (!layout || input.numel() == 0) {
    if constexpr (K::kGenericFallback) {
      return bn_act_generic(input, mean, var, weight, bias, eps, act, act_param);
    }
    unsupported("bn_act");
  }
  at::Tensor out = at::empty_like(input);
  K::apply(input, layout->first, mean, var, true, weight, bias, eps, a, act_param, out);
  return out;
}

template <typename K>
void bn_act_op_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    c10::string_view act, double act_param) {
  checks::bn_args(self, mean, var, weight, bias, "bn_act_");
  const Act a = parse_act(act);
  const auto layout = layout_of(self);
  if (!layout || self.numel() == 0) {
    if constexpr (K::kGenericFallback) {
      bn_act_generic_(self, mean, var, weight, bias, eps, act, act_param);
      return;
    }
    unsupported("bn_act_");
  }
  K::apply(self, layout->first, mean, var, true, weight, bias, eps, a, act_param, self);
}

template <typename K>
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_op(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act, double act_param,
    bool batch_stats, std::array<bool, 3> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward");
  const Act a = parse_act(act);
  const auto L = backward_layout(grad_out, input);
  if (!L) {
    if constexpr (K::kGenericFallback) {
      return bn_act_backward_generic(
          grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask);
    }
    unsupported("bn_act_backward");
  }
  at::Tensor grad_input = output_mask[0] ? at::empty_like(input) : at::Tensor();
  auto [grad_weight, grad_bias] = K::backward(
      dy_like(grad_out, input), input, *L, mean, var, true, weight, bias, eps, a, act_param,
      batch_stats, output_mask[1], output_mask[2], grad_input);
  return {grad_input, grad_weight, grad_bias};
}

// bn_act_backward_ (grad_input over the input: into_grad false) and
// bn_act_backward_into_grad_ (over grad_out).
template <typename K>
std::tuple<at::Tensor, at::Tensor> bn_act_backward_op_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act, double act_param,
    bool batch_stats, std::array<bool, 2> output_mask, bool into_grad) {
  const char* op = into_grad ? "bn_act_backward_into_grad_" : "bn_act_backward_";
  checks::bn_args(input, mean, var, weight, bias, op);
  const Act a = parse_act(act);
  const auto L = backward_layout(grad_out, input);
  // Into grad_out: truly in place only where grad_out already has the input's dtype and
  // layout (the kernels read it as dy); otherwise the generic form.
  const bool usable = L && (!into_grad || (grad_out.scalar_type() == input.scalar_type() &&
                                           grad_out.is_contiguous(input.suggest_memory_format())));
  if (!usable) {
    if constexpr (K::kGenericFallback) {
      return into_grad ? bn_act_backward_into_grad_generic_(
                             grad_out, input, mean, var, weight, bias, eps, act, act_param,
                             batch_stats, output_mask)
                       : bn_act_backward_generic_(
                             grad_out, input, mean, var, weight, bias, eps, act, act_param,
                             batch_stats, output_mask);
    }
    TORCH_CHECK(
        L.has_value(), "fxfuse::", op, ": expected a non-empty contiguous or channels_last input");
    TORCH_CHECK(false, "fxfuse::", op, ": expected grad_out in the input's dtype and layout");
  }
  const at::Tensor dy = into_grad ? grad_out : dy_like(grad_out, input);
  at::assert_no_partial_overlap(dy, input);
  return K::backward(
      dy, input, *L, mean, var, true, weight, bias, eps, a, act_param, batch_stats,
      output_mask[0], output_mask[1], into_grad ? grad_out : input);
}

}  // namespace fxfuse::elementwise
