// Autograd kernel of fxfuse::conv2d: keeps input, weight and bias, as eager's convolution
// does; its backward is fxfuse::conv2d_backward.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/conv2d.h>
#include <torch/library.h>

#include "../conv_ops.h"
#include "function.h"

namespace fxfuse {
namespace {

using autograd::AutogradContext;
using autograd::variable_list;

struct Conv2d : public torch::autograd::Function<Conv2d> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
      const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
      at::IntArrayRef dilation, int64_t groups) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fxfuse::conv2d", "")
                         .typed<decltype(conv2d_generic)>();
    ctx->set_materialize_grads(false);
    at::Tensor out;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      out = op.call(input, weight, bias, stride, padding, dilation, groups);
    }
    ctx->save_for_backward({input, weight, autograd::value(bias)});
    ctx->saved_data["edges"] = autograd::edges({true, true, autograd::value(bias).defined()});
    autograd::save_conv(ctx, stride, padding, dilation, groups);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("fxfuse::conv2d_backward", "")
                                  .typed<decltype(conv2d_backward_generic)>();
    constexpr size_t kArgs = 7;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(kArgs);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2];
    const auto conv = autograd::load_conv(ctx);
    const auto need = autograd::needed(ctx, {0, 1, 2});
    variable_list result;
    if (autograd::differentiating({grad_out, input, weight, bias})) {
      result = autograd::composed_gradients(
          [&](const variable_list& t) {
            return at::conv2d(
                t[0], t[1], autograd::optional(t[2]), conv.stride, conv.padding, conv.dilation,
                conv.groups);
          },
          {input, weight, bias}, need, grad_out);
    } else {
      const autograd::BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
      auto [gi, gw, gb] = backward_op.call(
          grad_out, input, weight, autograd::optional(bias), conv.stride, conv.padding,
          conv.dilation, conv.groups, {need[0], need[1], need[2]});
      result = {gi, gw, gb};
    }
    return autograd::gradients_at({0, 1, 2}, result, kArgs);
  }
};

at::Tensor conv2d_autograd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  return Conv2d::apply(input, weight, bias, stride, padding, dilation, groups);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("conv2d", &conv2d_autograd);
}

}  // namespace fxfuse
