// Autograd kernels of fxfuse::conv_bn_act and fxfuse::cat_conv_bn_act: keep the conv input (or
// its pieces), the weights and the per-channel
// statistics (fxfuse::conv_bn_act_backward recomputes the convolution).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/conv2d.h>
#include <torch/library.h>

#include "../bn_act.h"
#include "../dispatch.h"
#include "function.h"

namespace fxfuse {
namespace {

using autograd::AutogradContext;
using autograd::variable_list;

using ConvBnActFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
    at::IntArrayRef, at::IntArrayRef, int64_t, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, bool, double, c10::string_view, double);

using ConvBnActBackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, bool, double,
    c10::string_view, double, std::array<bool, 5>);

struct ConvBnAct : public torch::autograd::Function<ConvBnAct> {
  static variable_list forward(
      AutogradContext* ctx, at::TensorList pieces, const at::Tensor& input,
      const at::Tensor& weight, const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
      at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
      const std::optional<at::Tensor>& bn_weight,
      const std::optional<at::Tensor>& bn_bias, const std::optional<at::Tensor>& running_mean,
      const std::optional<at::Tensor>& running_var, bool batch_stats, double eps,
      c10::string_view act, double act_param) {
    ctx->set_materialize_grads(false);
    at::Tensor out, mean, var, unbiased_var;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      if (pieces.empty()) {
        std::tie(out, mean, var, unbiased_var) = dispatch::conv_bn_act(
            input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias,
            running_mean, running_var, batch_stats, eps, act, act_param);
      } else {
        static auto cat_op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fxfuse::cat_conv_bn_act", "")
                                 .typed<autograd::WithPieces<ConvBnActFn>::type>();
        std::tie(out, mean, var, unbiased_var) = cat_op.call(
            pieces, input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias,
            running_mean, running_var, batch_stats, eps, act, act_param);
      }
    }
    ctx->mark_non_differentiable({mean, var, unbiased_var});
    autograd::save_input_and(
        ctx, pieces, input,
        {weight, autograd::value(bias), autograd::value(bn_weight), autograd::value(bn_bias), mean,
         var});
    ctx->saved_data["edges"] = autograd::edges(
        {true, true, autograd::value(bias).defined(), autograd::value(bn_weight).defined(),
         autograd::value(bn_bias).defined(), autograd::value(running_mean).defined(),
         autograd::value(running_var).defined()},
        pieces.size());
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["batch_stats"] = batch_stats;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["act"] = static_cast<int64_t>(parse_act(act));
    ctx->saved_data["act_param"] = act_param;
    return {out, mean, var, unbiased_var};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr size_t kArgs = 15;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return autograd::no_gradients(ctx, kArgs);
    static auto backward_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("fxfuse::conv_bn_act_backward", "")
                                  .typed<ConvBnActBackwardFn>();
    const auto saved = autograd::load_input_and(ctx);
    const auto& rest = saved.rest;
    const at::Tensor &input = saved.input, &weight = rest[0], &bias = rest[1],
                     &bn_weight = rest[2], &bn_bias = rest[3], &mean = rest[4], &var = rest[5];
    auto& data = ctx->saved_data;
    const auto stride = data["stride"].toIntVector(), padding = data["padding"].toIntVector(),
               dilation = data["dilation"].toIntVector();
    const int64_t groups = data["groups"].toInt();
    const bool batch_stats = data["batch_stats"].toBool();
    const double eps = data["eps"].toDouble();
    const Act act = static_cast<Act>(data["act"].toInt());
    const double act_param = data["act_param"].toDouble();
    auto need = autograd::needed(ctx, {0, 1, 2, 3, 4});
    need[0] = autograd::input_needed(ctx, saved.pieces, need[0]);
    variable_list result;
    if (autograd::differentiating({grad_out, input, weight, bias, bn_weight, bn_bias})) {
      result = autograd::composed_gradients(
          [&](const variable_list& t) {
            const at::Tensor y =
                at::conv2d(t[0], t[1], autograd::optional(t[2]), stride, padding, dilation, groups);
            return autograd::normalize_act(y, mean, var, t[3], t[4], batch_stats, eps, act, act_param);
          },
          {input, weight, bias, bn_weight, bn_bias}, need, grad_out);
    } else {
      const autograd::BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
      auto [gi, gw, gb, gbw, gbb] = backward_op.call(
          grad_out, input, weight, autograd::optional(bias), stride, padding, dilation, groups,
          autograd::optional(bn_weight), autograd::optional(bn_bias), mean, var, batch_stats, eps,
          kActNames[static_cast<int>(act)], act_param,
          {need[0], need[1], need[2], need[3], need[4]});
      result = {gi, gw, gb, gbw, gbb};
    }
    return autograd::input_gradients_at(ctx, saved.pieces, {0, 1, 2, 7, 8}, result, kArgs);
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_act_autograd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    bool batch_stats, double eps, c10::string_view act, double act_param) {
  auto r = autograd::apply_dropping_marks<ConvBnAct>(
      at::TensorList(), input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias,
      running_mean, running_var, batch_stats, eps, act, act_param);
  return {r[0], r[1], r[2], r[3]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cat_conv_bn_act_autograd(
    at::TensorList pieces, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, const std::optional<at::Tensor>& bn_weight,
    const std::optional<at::Tensor>& bn_bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool batch_stats, double eps,
    c10::string_view act, double act_param) {
  auto r = autograd::apply_dropping_marks<ConvBnAct>(
      autograd::pieces_of(pieces), input, weight, bias, stride, padding, dilation, groups,
      bn_weight, bn_bias, running_mean, running_var, batch_stats, eps, act, act_param);
  return {r[0], r[1], r[2], r[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("conv_bn_act", &conv_bn_act_autograd);
  m.impl("cat_conv_bn_act", &cat_conv_bn_act_autograd);
}

}  // namespace fxfuse
