// What the ops' Autograd kernels (autograd/*.cpp) share. Each op's kernel is a
// torch::autograd::Function, registered as torchvision registers its ops' autograd
// (TORCH_LIBRARY_IMPL(fxfuse, Autograd, m)): forward runs the op below autograd and keeps what
// backward needs through ctx->save_for_backward (so saved-tensor hooks, offloading and
// checkpointing see it); backward runs the op's backward op. When grad mode is on in backward
// (create_graph=True) and something backward reads requires grad, backward instead recomputes
// the op as eager ATen ops from what it saved and differentiates that with create_graph: eager's
// own formulas through any order (fxfuse/ops/higher_order.py says why).
#pragma once

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/batch_norm.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <functional>
#include <initializer_list>
#include <optional>
#include <utility>
#include <vector>

#include "../activation_ops.h"

namespace fxfuse::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the ops holding a matmul run their forward below: autograd's keys only, not
// ADInplaceOrView, so that a view of a tensor that requires grad (F.linear's weight.t())
// requires grad as in eager, and at::matmul folds its operands as eager's does (its choice
// reads requires_grad): the same bits as eager. torchvision's AutoDispatchBelowADInplaceOrView
// would drop the views' autograd metadata.
using BelowAutograd = at::AutoDispatchBelowAutograd;

inline at::Tensor value(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

inline std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Autograd numbers a Function's edges over its defined tensor arguments only. `Edges` maps the
// op's tensor arguments, in order, to those numbers (-1: not given), and is kept in
// ctx->saved_data as a list.
inline std::vector<int64_t> edges(std::initializer_list<bool> defined) {
  std::vector<int64_t> result;
  int64_t next = 0;
  for (bool d : defined) result.push_back(d ? next++ : -1);
  return result;
}

// Whether autograd needs the gradient of each tensor argument at `positions` (indices into the
// list `edges` built).
inline std::vector<bool> needed(AutogradContext* ctx, std::initializer_list<int> positions) {
  const auto edge_of = ctx->saved_data.at("edges").toIntVector();
  std::vector<bool> result;
  for (int p : positions) {
    const int64_t e = edge_of[p];
    result.push_back(e >= 0 && ctx->needs_input_grad(static_cast<size_t>(e)));
  }
  return result;
}

// Whether a backward reading `tensors` runs for a graph of its own (create_graph=True).
inline bool differentiating(std::initializer_list<at::Tensor> tensors) {
  if (!at::GradMode::is_enabled()) return false;
  for (const auto& t : tensors) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

// Gradients of compose(tensors) against grad_out for the tensors `need` marks (undefined
// elsewhere), themselves differentiable in the tensors and grad_out.
inline variable_list composed_gradients(
    const std::function<at::Tensor(const variable_list&)>& compose, const variable_list& tensors,
    const std::vector<bool>& need, const at::Tensor& grad_out) {
  variable_list result(tensors.size());
  variable_list inputs;
  std::vector<size_t> at;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (need[i] && tensors[i].defined()) {
      inputs.push_back(tensors[i]);
      at.push_back(i);
    }
  }
  if (inputs.empty()) return result;
  const at::AutoGradMode enable(true);
  const at::Tensor out = compose(tensors);
  const auto grads = torch::autograd::grad(
      {out}, inputs, {grad_out}, /*retain_graph=*/std::nullopt, /*create_graph=*/true,
      /*allow_unused=*/true);
  for (size_t k = 0; k < at.size(); ++k) result[at[k]] = grads[k];
  return result;
}

// act(F.batch_norm(input, ...)) as differentiable eager ops that update no running statistics:
// on the batch's statistics, or on `mean` / `var` (constants).
inline at::Tensor normalize_act(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var, const at::Tensor& weight,
    const at::Tensor& bias, bool batch_stats, double eps, Act act, double act_param) {
  const bool cudnn = at::globalContext().userEnabledCuDNN();
  const at::Tensor out = batch_stats
      ? at::batch_norm(input, optional(weight), optional(bias), {}, {}, true, 0.0, eps, cudnn)
      : at::batch_norm(
            input, optional(weight), optional(bias), mean.detach(), var.detach(), false, 0.0, eps,
            cudnn);
  return act_forward(out, act, act_param);
}

// An activation and its parameter, kept in ctx->saved_data for backward.
inline void save_act(AutogradContext* ctx, c10::string_view act, double act_param) {
  ctx->saved_data["act"] = static_cast<int64_t>(parse_act(act));
  ctx->saved_data["act_param"] = act_param;
}

inline std::pair<Act, double> load_act(AutogradContext* ctx) {
  return {static_cast<Act>(ctx->saved_data["act"].toInt()), ctx->saved_data["act_param"].toDouble()};
}

// A convolution's geometry (stride, padding, dilation, groups), kept in ctx->saved_data.
struct ConvGeometry {
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups;
};

inline void save_conv(
    AutogradContext* ctx, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
    int64_t groups) {
  ctx->saved_data["stride"] = stride.vec();
  ctx->saved_data["padding"] = padding.vec();
  ctx->saved_data["dilation"] = dilation.vec();
  ctx->saved_data["groups"] = groups;
}

inline ConvGeometry load_conv(AutogradContext* ctx) {
  auto& data = ctx->saved_data;
  return {
      data["stride"].toIntVector(), data["padding"].toIntVector(), data["dilation"].toIntVector(),
      data["groups"].toInt()};
}

// The gradients a backward returns: one per forward argument, `grads` at `positions`.
inline variable_list gradients_at(
    std::initializer_list<int> positions, const variable_list& grads, size_t count) {
  variable_list result(count);
  size_t k = 0;
  for (int p : positions) result[p] = grads[k++];
  return result;
}

}  // namespace fxfuse::autograd
