// Autograd kernels of fxfuse::conv2d and fxfuse::cat_conv2d: keep input (or its pieces), weight
// and bias, as eager's convolution does; the backward is fxfuse::conv2d_backward.
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
      AutogradContext* ctx, at::TensorList pieces, const at::Tensor& input,
      const at::Tensor& weight, const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
      at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fxfuse::conv2d", "")
                         .typed<decltype(conv2d_generic)>();
    ctx->set_materialize_grads(false);
    at::Tensor out;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      if (pieces.empty()) {
        out = op.call(input, weight, bias, stride, padding, dilation, groups);
      } else {
        static auto cat_op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fxfuse::cat_conv2d", "")
                                 .typed<autograd::WithPieces<decltype(conv2d_generic)>::type>();
        out = cat_op.call(pieces, input, weight, bias, stride, padding, dilation, groups);
      }
    }
    autograd::save_input_and(ctx, pieces, input, {weight, autograd::value(bias)});
    ctx->saved_data["edges"] =
        autograd::edges({true, true, autograd::value(bias).defined()}, pieces.size());
    autograd::save_conv(ctx, stride, padding, dilation, groups);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("fxfuse::conv2d_backward", "")
                                  .typed<decltype(conv2d_backward_generic)>();
    constexpr size_t kArgs = 7;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return autograd::no_gradients(ctx, kArgs);
    const auto saved = autograd::load_input_and(ctx);
    const at::Tensor &input = saved.input, &weight = saved.rest[0], &bias = saved.rest[1];
    const auto conv = autograd::load_conv(ctx);
    auto need = autograd::needed(ctx, {0, 1, 2});
    need[0] = autograd::input_needed(ctx, saved.pieces, need[0]);
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
    return autograd::input_gradients_at(ctx, saved.pieces, {0, 1, 2}, result, kArgs);
  }
};

at::Tensor conv2d_autograd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  return Conv2d::apply(at::TensorList(), input, weight, bias, stride, padding, dilation, groups);
}

at::Tensor cat_conv2d_autograd(
    at::TensorList pieces, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups) {
  return Conv2d::apply(
      autograd::pieces_of(pieces), input, weight, bias, stride, padding, dilation, groups);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("conv2d", &conv2d_autograd);
  m.impl("cat_conv2d", &cat_conv2d_autograd);
}

}  // namespace fxfuse
