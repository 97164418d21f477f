// What the ops' Autograd kernels (autograd/*.cpp) share. Each op's kernel is a
// torch::autograd::Function, registered as torchvision registers its ops' autograd
// (TORCH_LIBRARY_IMPL(fxfuse, Autograd, m)): forward runs the op below autograd and keeps what
// backward needs through ctx->save_for_backward (so saved-tensor hooks, offloading and
// checkpointing see it); backward runs the op's backward op. When grad mode is on in backward
// (create_graph=True) and something backward reads requires grad, backward instead recomputes
// the op as eager ATen ops from what it saved and differentiates that with create_graph: eager's
// own formulas through any order (fxfuse/ops/higher_order.py says why).
//
// batch_norm_act, conv_bn_act, bn_act_conv and conv2d's Functions also serve their cat_ variants
// (fxfuse/ops/cat_input.py): given `pieces`, the tensors whose concatenation along dim 1 is the
// op's input (its argument 0), the Function keeps the pieces in place of the input, concatenates
// them again in backward and gives each piece its slice of the input's gradient, as eager's cat
// backward does; the input itself gets none. With no pieces it is the op's own.
#pragma once

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/batch_norm.h>
#include <ATen/ops/cat.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <functional>
#include <initializer_list>
#include <optional>
#include <unordered_set>
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
// ctx->saved_data as a list. A cat_ variant's pieces come first: edges 0 to `pieces` - 1.
inline std::vector<int64_t> edges(std::initializer_list<bool> defined, size_t pieces = 0) {
  std::vector<int64_t> result;
  auto next = static_cast<int64_t>(pieces);
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

// T::apply for a Function whose forward marks outputs non-differentiable. The marks are read
// only while apply wraps the outputs; compiled autograd asserts a C++ Function's context holds
// none (CppNode::compiled_args), so they are dropped once apply is done with them.
template <class T, class... Args>
variable_list apply_dropping_marks(Args&&... args) {
  variable_list outputs = T::apply(std::forward<Args>(args)...);
  if (auto* node = dynamic_cast<torch::autograd::CppNode<T>*>(outputs[0].grad_fn().get())) {
    using Marks = std::unordered_set<at::TensorImpl*>;
    const_cast<Marks&>(node->ctx_.get_non_differentiable()).clear();
  }
  return outputs;
}

// The signature of fxfuse::cat_<op>: <op>'s, `Fn`, with the pieces first.
template <class Fn>
struct WithPieces;
template <class R, class... Args>
struct WithPieces<R(Args...)> {
  using type = R(at::TensorList, Args...);
};

// A cat_ variant's pieces: with none the Function would be the op's own (the op's kernel,
// cat_input.h's check_pieces, checks the rest).
inline at::TensorList pieces_of(at::TensorList pieces) {
  TORCH_CHECK(!pieces.empty(), "fxfuse::cat_*: expected at least one piece");
  return pieces;
}

// What a Function keeps for backward: its input, or a cat_ variant's pieces in its place, then
// `rest`. How many pieces there were is in the Function's `edges` (built with their count).
inline void save_input_and(
    AutogradContext* ctx, at::TensorList pieces, const at::Tensor& input,
    std::initializer_list<at::Tensor> rest) {
  variable_list saved;
  saved.reserve(pieces.size() + 1 + rest.size());
  if (pieces.empty()) {
    saved.push_back(input);
  } else {
    saved.insert(saved.end(), pieces.begin(), pieces.end());
  }
  saved.insert(saved.end(), rest.begin(), rest.end());
  ctx->save_for_backward(saved);
}

// How many pieces save_input_and kept (0: the input itself), read off `edges`: the input is
// always given, so its edge comes right after the pieces'.
inline size_t piece_count(AutogradContext* ctx) {
  return static_cast<size_t>(ctx->saved_data.at("edges").toIntList().get(0));
}

// What save_input_and kept: the input (the pieces concatenated again: the same values in the
// same layout, differentiable in the pieces when backward runs for a graph of its own), the
// pieces and the rest.
struct SavedInput {
  at::Tensor input;
  variable_list pieces;
  variable_list rest;
};

inline SavedInput load_input_and(AutogradContext* ctx) {
  auto saved = ctx->get_saved_variables();
  const auto count = piece_count(ctx);
  SavedInput result;
  if (count == 0) {
    result.input = saved[0];
    result.rest.assign(saved.begin() + 1, saved.end());
  } else {
    result.pieces.assign(saved.begin(), saved.begin() + static_cast<std::ptrdiff_t>(count));
    result.rest.assign(saved.begin() + static_cast<std::ptrdiff_t>(count), saved.end());
    // The dim in its negative form: under torch.compile, AOTAutograd's CSE would otherwise merge
    // this cat with the forward's, and its partitioner, which does not recompute a cat, would keep
    // the concatenation after all (tests/test_ops_cat_input.py).
    result.input = at::cat(result.pieces, 1 - result.pieces[0].dim());
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

// What a backward returns when no gradient reached it: none for each of the op's `count`
// arguments and a cat_ variant's pieces.
inline variable_list no_gradients(AutogradContext* ctx, size_t count) {
  return variable_list(count + piece_count(ctx));
}

// Whether the input's gradient is needed, `need` (needed's answer for argument 0), or for a
// cat_ variant whether a piece's is: its input argument gets no gradient.
inline bool input_needed(AutogradContext* ctx, const variable_list& pieces, bool need) {
  if (pieces.empty()) return need;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (ctx->needs_input_grad(i)) return true;
  }
  return false;
}

// gradients_at's answer for an op whose input (argument 0) may be a cat_ variant's pieces:
// each piece that needs one gets its slice of the input's gradient along dim 1 (undefined
// where none was computed), ahead of the op's arguments; the input argument gets none.
inline variable_list input_gradients_at(
    AutogradContext* ctx, const variable_list& pieces, std::initializer_list<int> positions,
    const variable_list& grads, size_t count) {
  variable_list result = gradients_at(positions, grads, count);
  if (pieces.empty()) return result;
  const at::Tensor grad_input = std::move(result[0]);
  result[0] = at::Tensor();
  variable_list piece_grads(pieces.size());
  int64_t offset = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int64_t size = pieces[i].size(1);
    if (grad_input.defined() && ctx->needs_input_grad(i)) {
      piece_grads[i] = grad_input.narrow(1, offset, size);
    }
    offset += size;
  }
  result.insert(result.begin(), piece_grads.begin(), piece_grads.end());
  return result;
}

}  // namespace fxfuse::autograd
