// Autograd kernels of fxfuse::layer_norm_linear and fxfuse::conv_layer_norm_linear: keep the
// input and the parameters (the backward ops recompute the layer norm, and the convolution).
// Their compositions cast the layer norm's output to the linear's dtype, the form the Autocast
// kernels call them in.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "function.h"

namespace fxfuse {
namespace {

using autograd::AutogradContext;
using autograd::optional;
using autograd::value;
using autograd::variable_list;

using LayerNormLinearFn = at::Tensor(
    const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, double, const at::Tensor&, const std::optional<at::Tensor>&);
using LayerNormLinearBackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, double, const at::Tensor&, const std::optional<at::Tensor>&,
    std::array<bool, 5>);
using ConvLayerNormLinearFn = at::Tensor(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
    at::IntArrayRef, at::IntArrayRef, int64_t, at::IntArrayRef, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, double, const at::Tensor&, const std::optional<at::Tensor>&);
using ConvLayerNormLinearBackwardFn =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
        at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, at::IntArrayRef,
        const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double,
        const at::Tensor&, const std::optional<at::Tensor>&, std::array<bool, 7>);

// linear(layer_norm(z).to(weight's dtype)), differentiable.
at::Tensor norm_linear(
    const at::Tensor& z, at::IntArrayRef shape, const at::Tensor& ln_weight, const at::Tensor& ln_bias,
    double eps, const at::Tensor& weight, const at::Tensor& bias) {
  const at::Tensor y = at::layer_norm(z, shape, optional(ln_weight), optional(ln_bias), eps);
  return at::linear(y.to(weight.scalar_type()), weight, optional(bias));
}

struct LayerNormLinear : public torch::autograd::Function<LayerNormLinear> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& input, at::IntArrayRef normalized_shape,
      const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
      double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fxfuse::layer_norm_linear", "")
                         .typed<LayerNormLinearFn>();
    ctx->set_materialize_grads(false);
    at::Tensor out;
    {
      const autograd::BelowAutograd below;
      out = op.call(input, normalized_shape, ln_weight, ln_bias, eps, weight, bias);
    }
    ctx->save_for_backward({input, value(ln_weight), value(ln_bias), weight, value(bias)});
    ctx->saved_data["edges"] = autograd::edges(
        {true, value(ln_weight).defined(), value(ln_bias).defined(), true, value(bias).defined()});
    ctx->saved_data["shape"] = normalized_shape.vec();
    ctx->saved_data["eps"] = eps;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("fxfuse::layer_norm_linear_backward", "")
                                  .typed<LayerNormLinearBackwardFn>();
    constexpr size_t kArgs = 7;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(kArgs);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &ln_weight = saved[1], &ln_bias = saved[2],
                     &weight = saved[3], &bias = saved[4];
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const double eps = ctx->saved_data["eps"].toDouble();
    const auto need = autograd::needed(ctx, {0, 1, 2, 3, 4});
    variable_list result;
    if (autograd::differentiating({grad_out, input, ln_weight, ln_bias, weight, bias})) {
      result = autograd::composed_gradients(
          [&](const variable_list& t) { return norm_linear(t[0], shape, t[1], t[2], eps, t[3], t[4]); },
          {input, ln_weight, ln_bias, weight, bias}, need, grad_out);
    } else {
      const autograd::BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
      auto [gi, glw, glb, gw, gb] = backward_op.call(
          grad_out, input, shape, optional(ln_weight), optional(ln_bias), eps, weight, optional(bias),
          {need[0], need[1], need[2], need[3], need[4]});
      result = {gi, glw, glb, gw, gb};
    }
    return autograd::gradients_at({0, 2, 3, 5, 6}, result, kArgs);
  }
};

struct ConvLayerNormLinear : public torch::autograd::Function<ConvLayerNormLinear> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& input, const at::Tensor& conv_weight,
      const std::optional<at::Tensor>& conv_bias, at::IntArrayRef stride, at::IntArrayRef padding,
      at::IntArrayRef dilation, int64_t groups, at::IntArrayRef normalized_shape,
      const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
      double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fxfuse::conv_layer_norm_linear", "")
                         .typed<ConvLayerNormLinearFn>();
    ctx->set_materialize_grads(false);
    at::Tensor out;
    {
      const autograd::BelowAutograd below;
      out = op.call(
          input, conv_weight, conv_bias, stride, padding, dilation, groups, normalized_shape,
          ln_weight, ln_bias, eps, weight, bias);
    }
    ctx->save_for_backward(
        {input, conv_weight, value(conv_bias), value(ln_weight), value(ln_bias), weight,
         value(bias)});
    ctx->saved_data["edges"] = autograd::edges(
        {true, true, value(conv_bias).defined(), value(ln_weight).defined(),
         value(ln_bias).defined(), true, value(bias).defined()});
    autograd::save_conv(ctx, stride, padding, dilation, groups);
    ctx->saved_data["shape"] = normalized_shape.vec();
    ctx->saved_data["eps"] = eps;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("fxfuse::conv_layer_norm_linear_backward", "")
                                  .typed<ConvLayerNormLinearBackwardFn>();
    constexpr size_t kArgs = 13;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(kArgs);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &conv_weight = saved[1], &conv_bias = saved[2],
                     &ln_weight = saved[3], &ln_bias = saved[4], &weight = saved[5],
                     &bias = saved[6];
    const auto conv = autograd::load_conv(ctx);
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const double eps = ctx->saved_data["eps"].toDouble();
    const auto need = autograd::needed(ctx, {0, 1, 2, 3, 4, 5, 6});
    variable_list result;
    if (autograd::differentiating(
            {grad_out, input, conv_weight, conv_bias, ln_weight, ln_bias, weight, bias})) {
      result = autograd::composed_gradients(
          [&](const variable_list& t) {
            const at::Tensor z = at::conv2d(
                                     t[0], t[1], optional(t[2]), conv.stride, conv.padding,
                                     conv.dilation, conv.groups)
                                     .permute({0, 2, 3, 1});
            return norm_linear(z, shape, t[3], t[4], eps, t[5], t[6]);
          },
          {input, conv_weight, conv_bias, ln_weight, ln_bias, weight, bias}, need, grad_out);
    } else {
      const autograd::BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
      auto [gi, gcw, gcb, glw, glb, gw, gb] = backward_op.call(
          grad_out, input, conv_weight, optional(conv_bias), conv.stride, conv.padding,
          conv.dilation, conv.groups, shape, optional(ln_weight), optional(ln_bias), eps, weight,
          optional(bias), {need[0], need[1], need[2], need[3], need[4], need[5], need[6]});
      result = {gi, gcw, gcb, glw, glb, gw, gb};
    }
    return autograd::gradients_at({0, 1, 2, 8, 9, 11, 12}, result, kArgs);
  }
};

at::Tensor layer_norm_linear_autograd(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
    double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return LayerNormLinear::apply(input, normalized_shape, ln_weight, ln_bias, eps, weight, bias);
}

at::Tensor conv_layer_norm_linear_autograd(
    const at::Tensor& input, const at::Tensor& conv_weight,
    const std::optional<at::Tensor>& conv_bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
    double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return ConvLayerNormLinear::apply(
      input, conv_weight, conv_bias, stride, padding, dilation, groups, normalized_shape,
      ln_weight, ln_bias, eps, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("layer_norm_linear", &layer_norm_linear_autograd);
  m.impl("conv_layer_norm_linear", &conv_layer_norm_linear_autograd);
}

}  // namespace fxfuse
