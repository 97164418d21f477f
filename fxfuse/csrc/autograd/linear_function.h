// The Autograd kernel of the ops that are one linear layer and an activation (linear_act,
// act_linear): one schema, input, weight and bias saved, the backward op recomputes the rest.
// `Traits` names the op (kName, kBackward) and gives its composition for create_graph.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>

#include <array>
#include <tuple>

#include "function.h"

namespace fxfuse::autograd {

using LinearFn = at::Tensor(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view, double);
using LinearBackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    c10::string_view, double, std::array<bool, 3>);

template <typename Traits>
struct LinearFunction : public torch::autograd::Function<LinearFunction<Traits>> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
      const std::optional<at::Tensor>& bias, c10::string_view act, double act_param) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow(Traits::kName, "").template typed<LinearFn>();
    ctx->set_materialize_grads(false);
    at::Tensor out;
    {
      const BelowAutograd below;
      out = op.call(input, weight, bias, act, act_param);
    }
    ctx->save_for_backward({input, weight, value(bias)});
    ctx->saved_data["edges"] = edges({true, true, value(bias).defined()});
    save_act(ctx, act, act_param);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow(Traits::kBackward, "")
                                  .template typed<LinearBackwardFn>();
    constexpr size_t kArgs = 5;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(kArgs);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2];
    const auto [act, act_param] = load_act(ctx);
    const auto need = needed(ctx, {0, 1, 2});
    variable_list result;
    if (differentiating({grad_out, input, weight, bias})) {
      result = composed_gradients(
          [&](const variable_list& t) { return Traits::compose(t[0], t[1], t[2], act, act_param); },
          {input, weight, bias}, need, grad_out);
    } else {
      const BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
      auto [gi, gw, gb] = backward_op.call(
          grad_out, input, weight, optional(bias), kActNames[static_cast<int>(act)], act_param,
          {need[0], need[1], need[2]});
      result = {gi, gw, gb};
    }
    return gradients_at({0, 1, 2}, result, kArgs);
  }
};

}  // namespace fxfuse::autograd
