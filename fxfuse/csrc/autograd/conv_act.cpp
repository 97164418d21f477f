// Autograd kernel of fxfuse::conv_act: keeps input, weight and bias (the backward op
// recomputes the convolution).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/conv2d.h>
#include <torch/library.h>

#include "function.h"

namespace fxfuse {
namespace {

using autograd::AutogradContext;
using autograd::variable_list;

using ConvActFn = at::Tensor(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
    at::IntArrayRef, at::IntArrayRef, int64_t, c10::string_view, double);
using ConvActBackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, c10::string_view, double,
    std::array<bool, 3>);

struct ConvAct : public torch::autograd::Function<ConvAct> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
      const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
      at::IntArrayRef dilation, int64_t groups, c10::string_view act, double act_param) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("fxfuse::conv_act", "").typed<ConvActFn>();
    ctx->set_materialize_grads(false);
    at::Tensor out;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      out = op.call(input, weight, bias, stride, padding, dilation, groups, act, act_param);
    }
    ctx->save_for_backward({input, weight, autograd::value(bias)});
    ctx->saved_data["edges"] = autograd::edges({true, true, autograd::value(bias).defined()});
    autograd::save_conv(ctx, stride, padding, dilation, groups);
    autograd::save_act(ctx, act, act_param);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("fxfuse::conv_act_backward", "")
                                  .typed<ConvActBackwardFn>();
    constexpr size_t kArgs = 9;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(kArgs);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2];
    const auto conv = autograd::load_conv(ctx);
    const auto [act, act_param] = autograd::load_act(ctx);
    const auto need = autograd::needed(ctx, {0, 1, 2});
    variable_list result;
    if (autograd::differentiating({grad_out, input, weight, bias})) {
      result = autograd::composed_gradients(
          [&](const variable_list& t) {
            return act_forward(
                at::conv2d(
                    t[0], t[1], autograd::optional(t[2]), conv.stride, conv.padding, conv.dilation,
                    conv.groups),
                act, act_param);
          },
          {input, weight, bias}, need, grad_out);
    } else {
      const autograd::BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
      auto [gi, gw, gb] = backward_op.call(
          grad_out, input, weight, autograd::optional(bias), conv.stride, conv.padding,
          conv.dilation, conv.groups, kActNames[static_cast<int>(act)], act_param,
          {need[0], need[1], need[2]});
      result = {gi, gw, gb};
    }
    return autograd::gradients_at({0, 1, 2}, result, kArgs);
  }
};

at::Tensor conv_act_autograd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    c10::string_view act, double act_param) {
  return ConvAct::apply(input, weight, bias, stride, padding, dilation, groups, act, act_param);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("conv_act", &conv_act_autograd);
}

}  // namespace fxfuse
