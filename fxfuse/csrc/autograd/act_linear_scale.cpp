// Autograd kernel of fxfuse::act_linear_scale: keeps input, weight, bias and scale (the
// backward op recomputes the activation and the linear's output).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>

#include "function.h"

namespace fxfuse {
namespace {

using autograd::AutogradContext;
using autograd::variable_list;

using ActLinearScaleFn = at::Tensor(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
    c10::string_view, double);
using ActLinearScaleBackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const at::Tensor&, c10::string_view, double, std::array<bool, 4>);

struct ActLinearScale : public torch::autograd::Function<ActLinearScale> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
      const std::optional<at::Tensor>& bias, const at::Tensor& scale, c10::string_view act,
      double act_param) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fxfuse::act_linear_scale", "")
                         .typed<ActLinearScaleFn>();
    ctx->set_materialize_grads(false);
    at::Tensor out;
    {
      const autograd::BelowAutograd below;
      out = op.call(input, weight, bias, scale, act, act_param);
    }
    ctx->save_for_backward({input, weight, autograd::value(bias), scale});
    ctx->saved_data["edges"] = autograd::edges({true, true, autograd::value(bias).defined(), true});
    autograd::save_act(ctx, act, act_param);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("fxfuse::act_linear_scale_backward", "")
                                  .typed<ActLinearScaleBackwardFn>();
    constexpr size_t kArgs = 6;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(kArgs);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2], &scale = saved[3];
    const auto [act, act_param] = autograd::load_act(ctx);
    const auto need = autograd::needed(ctx, {0, 1, 2, 3});
    variable_list result;
    if (autograd::differentiating({grad_out, input, weight, bias, scale})) {
      result = autograd::composed_gradients(
          [&](const variable_list& t) {
            const at::Tensor a = act_forward(t[0], act, act_param).to(t[1].scalar_type());
            return at::mul(at::linear(a, t[1], autograd::optional(t[2])), t[3]);
          },
          {input, weight, bias, scale}, need, grad_out);
    } else {
      const autograd::BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
      auto [gi, gw, gb, gs] = backward_op.call(
          grad_out, input, weight, autograd::optional(bias), scale,
          kActNames[static_cast<int>(act)], act_param, {need[0], need[1], need[2], need[3]});
      result = {gi, gw, gb, gs};
    }
    return autograd::gradients_at({0, 1, 2, 3}, result, kArgs);
  }
};

at::Tensor act_linear_scale_autograd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& scale, c10::string_view act, double act_param) {
  return ActLinearScale::apply(input, weight, bias, scale, act, act_param);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("act_linear_scale", &act_linear_scale_autograd);
}

}  // namespace fxfuse
