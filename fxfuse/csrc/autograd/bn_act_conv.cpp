// Autograd kernels of fxfuse::bn_act_conv and fxfuse::cat_bn_act_conv: keep the first BN's input
// (or its pieces), the weights and both
// BNs' per-channel statistics (fxfuse::bn_act_conv_backward rebuilds the conv input and, with
// the epilogue, recomputes the conv output).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/conv2d.h>
#include <torch/library.h>

#include "../bn_act.h"
#include "function.h"

namespace fxfuse {
namespace {

using autograd::AutogradContext;
using autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

using BnActConvFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, bool,
    double, c10::string_view, double, const at::Tensor&, const OptTensor&, at::IntArrayRef,
    at::IntArrayRef, at::IntArrayRef, int64_t, bool, const OptTensor&, const OptTensor&,
    const OptTensor&, const OptTensor&, bool, double, c10::string_view, double);

using BnActConvBackwardFn =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, const at::Tensor&,
        const at::Tensor&, bool, double, c10::string_view, double, const at::Tensor&,
        const OptTensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, bool,
        const OptTensor&, const OptTensor&, const at::Tensor&, const at::Tensor&, bool, double,
        c10::string_view, double, std::array<bool, 7>);

struct BnActConv : public torch::autograd::Function<BnActConv> {
  static variable_list forward(
      AutogradContext* ctx, at::TensorList pieces, const at::Tensor& input,
      const OptTensor& in_weight,
      const OptTensor& in_bias, const OptTensor& in_running_mean, const OptTensor& in_running_var,
      bool in_batch_stats, double in_eps, c10::string_view in_act, double in_act_param,
      const at::Tensor& weight, const OptTensor& bias, at::IntArrayRef stride,
      at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool epilogue,
      const OptTensor& bn_weight, const OptTensor& bn_bias, const OptTensor& running_mean,
      const OptTensor& running_var, bool batch_stats, double eps, c10::string_view act,
      double act_param) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fxfuse::bn_act_conv", "")
                         .typed<BnActConvFn>();
    ctx->set_materialize_grads(false);
    variable_list out(7);
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      if (pieces.empty()) {
        std::tie(out[0], out[1], out[2], out[3], out[4], out[5], out[6]) = op.call(
            input, in_weight, in_bias, in_running_mean, in_running_var, in_batch_stats, in_eps,
            in_act, in_act_param, weight, bias, stride, padding, dilation, groups, epilogue,
            bn_weight, bn_bias, running_mean, running_var, batch_stats, eps, act, act_param);
      } else {
        static auto cat_op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fxfuse::cat_bn_act_conv", "")
                                 .typed<autograd::WithPieces<BnActConvFn>::type>();
        std::tie(out[0], out[1], out[2], out[3], out[4], out[5], out[6]) = cat_op.call(
            pieces, input, in_weight, in_bias, in_running_mean, in_running_var, in_batch_stats,
            in_eps, in_act, in_act_param, weight, bias, stride, padding, dilation, groups, epilogue,
            bn_weight, bn_bias, running_mean, running_var, batch_stats, eps, act, act_param);
      }
    }
    using autograd::value;
    ctx->mark_non_differentiable({out[1], out[2], out[3], out[4], out[5], out[6]});
    // The BN input, weights and per-channel statistics: the activation output and (with the
    // epilogue) the conv output are rebuilt in backward.
    autograd::save_input_and(
        ctx, pieces, input,
        {value(in_weight), value(in_bias), out[1], out[2], weight, value(bias), value(bn_weight),
         value(bn_bias), out[4], out[5]});
    ctx->saved_data["edges"] = autograd::edges(
        {true, value(in_weight).defined(), value(in_bias).defined(),
         value(in_running_mean).defined(), value(in_running_var).defined(), true,
         value(bias).defined(), value(bn_weight).defined(), value(bn_bias).defined(),
         value(running_mean).defined(), value(running_var).defined()},
        pieces.size());
    auto& data = ctx->saved_data;
    data["in_batch_stats"] = in_batch_stats;
    data["in_eps"] = in_eps;
    data["in_act"] = static_cast<int64_t>(parse_act(in_act));
    data["in_act_param"] = in_act_param;
    data["stride"] = stride.vec();
    data["padding"] = padding.vec();
    data["dilation"] = dilation.vec();
    data["groups"] = groups;
    data["epilogue"] = epilogue;
    data["batch_stats"] = batch_stats;
    data["eps"] = eps;
    data["act"] = static_cast<int64_t>(parse_act(act));
    data["act_param"] = act_param;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr size_t kArgs = 24;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return autograd::no_gradients(ctx, kArgs);
    static auto backward_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("fxfuse::bn_act_conv_backward", "")
                                  .typed<BnActConvBackwardFn>();
    const auto saved = autograd::load_input_and(ctx);
    const auto& s = saved.rest;
    const at::Tensor &input = saved.input, &in_weight = s[0], &in_bias = s[1], &in_mean = s[2],
                     &in_var = s[3], &weight = s[4], &bias = s[5], &bn_weight = s[6],
                     &bn_bias = s[7], &mean = s[8], &var = s[9];
    auto& data = ctx->saved_data;
    const bool in_batch_stats = data["in_batch_stats"].toBool();
    const double in_eps = data["in_eps"].toDouble();
    const Act in_act = static_cast<Act>(data["in_act"].toInt());
    const double in_act_param = data["in_act_param"].toDouble();
    const auto stride = data["stride"].toIntVector(), padding = data["padding"].toIntVector(),
               dilation = data["dilation"].toIntVector();
    const int64_t groups = data["groups"].toInt();
    const bool epilogue = data["epilogue"].toBool();
    const bool batch_stats = data["batch_stats"].toBool();
    const double eps = data["eps"].toDouble();
    const Act act = static_cast<Act>(data["act"].toInt());
    const double act_param = data["act_param"].toDouble();
    // Tensor arguments (edges list order): input 0, in_weight 1, in_bias 2, weight 5, bias 6,
    // bn_weight 7, bn_bias 8.
    auto need = autograd::needed(ctx, {0, 1, 2, 5, 6, 7, 8});
    need[0] = autograd::input_needed(ctx, saved.pieces, need[0]);
    variable_list result;
    if (autograd::differentiating({grad_out, input, in_weight, in_bias, weight, bias, bn_weight, bn_bias})) {
      result = autograd::composed_gradients(
          [&](const variable_list& t) {
            const at::Tensor x = autograd::normalize_act(
                t[0], in_mean, in_var, t[1], t[2], in_batch_stats, in_eps, in_act, in_act_param);
            const at::Tensor y =
                at::conv2d(x, t[3], autograd::optional(t[4]), stride, padding, dilation, groups);
            return epilogue
                ? autograd::normalize_act(y, mean, var, t[5], t[6], batch_stats, eps, act, act_param)
                : y;
          },
          {input, in_weight, in_bias, weight, bias, bn_weight, bn_bias}, need, grad_out);
    } else {
      using autograd::optional;
      const autograd::BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
      auto r = backward_op.call(
          grad_out, input, optional(in_weight), optional(in_bias), in_mean, in_var, in_batch_stats,
          in_eps, kActNames[static_cast<int>(in_act)], in_act_param, weight, optional(bias), stride,
          padding, dilation, groups, epilogue, optional(bn_weight), optional(bn_bias), mean, var,
          batch_stats, eps, kActNames[static_cast<int>(act)], act_param,
          {need[0], need[1], need[2], need[3], need[4], need[5], need[6]});
      result = {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r),
                std::get<4>(r), std::get<5>(r), std::get<6>(r)};
    }
    return autograd::input_gradients_at(
        ctx, saved.pieces, {0, 1, 2, 9, 10, 16, 17}, result, kArgs);
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
bn_act_conv_autograd(
    const at::Tensor& input, const OptTensor& in_weight, const OptTensor& in_bias,
    const OptTensor& in_running_mean, const OptTensor& in_running_var, bool in_batch_stats,
    double in_eps, c10::string_view in_act, double in_act_param, const at::Tensor& weight,
    const OptTensor& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, bool epilogue, const OptTensor& bn_weight,
    const OptTensor& bn_bias, const OptTensor& running_mean, const OptTensor& running_var,
    bool batch_stats, double eps, c10::string_view act, double act_param) {
  auto r = autograd::apply_dropping_marks<BnActConv>(
      at::TensorList(), input, in_weight, in_bias, in_running_mean, in_running_var, in_batch_stats,
      in_eps, in_act, in_act_param, weight, bias, stride, padding, dilation, groups, epilogue,
      bn_weight, bn_bias, running_mean, running_var, batch_stats, eps, act, act_param);
  return {r[0], r[1], r[2], r[3], r[4], r[5], r[6]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
cat_bn_act_conv_autograd(
    at::TensorList pieces, const at::Tensor& input, const OptTensor& in_weight,
    const OptTensor& in_bias, const OptTensor& in_running_mean, const OptTensor& in_running_var,
    bool in_batch_stats, double in_eps, c10::string_view in_act, double in_act_param,
    const at::Tensor& weight, const OptTensor& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool epilogue,
    const OptTensor& bn_weight, const OptTensor& bn_bias, const OptTensor& running_mean,
    const OptTensor& running_var, bool batch_stats, double eps, c10::string_view act,
    double act_param) {
  auto r = autograd::apply_dropping_marks<BnActConv>(
      autograd::pieces_of(pieces), input, in_weight, in_bias, in_running_mean, in_running_var,
      in_batch_stats, in_eps, in_act, in_act_param, weight, bias, stride, padding, dilation, groups,
      epilogue, bn_weight, bn_bias, running_mean, running_var, batch_stats, eps, act, act_param);
  return {r[0], r[1], r[2], r[3], r[4], r[5], r[6]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("bn_act_conv", &bn_act_conv_autograd);
  m.impl("cat_bn_act_conv", &cat_bn_act_conv_autograd);
}

}  // namespace fxfuse
