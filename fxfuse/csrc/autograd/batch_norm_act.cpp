// Autograd kernels of fxfuse::batch_norm_act, fxfuse::cat_batch_norm_act and fxfuse::bn_act:
// keep the BN input (or its pieces) and the per-channel statistics (the normalized value and the
// activation input are recomputed in backward by fxfuse::bn_act_backward). bn_act normalizes by
// the statistics it is given, which its backward treats as constants.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "../bn_act.h"
#include "../dispatch.h"
#include "function.h"

namespace fxfuse {
namespace {

using autograd::AutogradContext;
using autograd::variable_list;

using BatchNormActFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, double,
    c10::string_view, double);

struct BatchNormAct : public torch::autograd::Function<BatchNormAct> {
  static variable_list forward(
      AutogradContext* ctx, at::TensorList pieces, const at::Tensor& input,
      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
      const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
      bool batch_stats, double eps, c10::string_view act, double act_param) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fxfuse::batch_norm_act", "")
                         .typed<BatchNormActFn>();
    // Every backward reads only the output's gradient: the statistics' are never materialized.
    ctx->set_materialize_grads(false);
    at::Tensor out, mean, var, unbiased_var;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      if (pieces.empty()) {
        std::tie(out, mean, var, unbiased_var) = op.call(
            input, weight, bias, running_mean, running_var, batch_stats, eps, act, act_param);
      } else {
        static auto cat_op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fxfuse::cat_batch_norm_act", "")
                                 .typed<autograd::WithPieces<BatchNormActFn>::type>();
        std::tie(out, mean, var, unbiased_var) = cat_op.call(
            pieces, input, weight, bias, running_mean, running_var, batch_stats, eps, act,
            act_param);
      }
    }
    // The statistics are outputs for the caller's running-statistics update: backward reads
    // only the output's gradient (batch statistics are differentiated through inside it).
    ctx->mark_non_differentiable({mean, var, unbiased_var});
    autograd::save_input_and(
        ctx, pieces, input, {mean, var, autograd::value(weight), autograd::value(bias)});
    ctx->saved_data["edges"] = autograd::edges(
        {true, autograd::value(weight).defined(), autograd::value(bias).defined(),
         autograd::value(running_mean).defined(), autograd::value(running_var).defined()},
        pieces.size());
    ctx->saved_data["batch_stats"] = batch_stats;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["act"] = static_cast<int64_t>(parse_act(act));
    ctx->saved_data["act_param"] = act_param;
    return {out, mean, var, unbiased_var};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr size_t kArgs = 9;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return autograd::no_gradients(ctx, kArgs);
    const auto saved = autograd::load_input_and(ctx);
    const at::Tensor &input = saved.input, &mean = saved.rest[0], &var = saved.rest[1],
                     &weight = saved.rest[2], &bias = saved.rest[3];
    const bool batch_stats = ctx->saved_data["batch_stats"].toBool();
    const double eps = ctx->saved_data["eps"].toDouble();
    const Act act = static_cast<Act>(ctx->saved_data["act"].toInt());
    const double act_param = ctx->saved_data["act_param"].toDouble();
    auto need = autograd::needed(ctx, {0, 1, 2});
    need[0] = autograd::input_needed(ctx, saved.pieces, need[0]);
    variable_list result;
    if (autograd::differentiating({grad_out, input, weight, bias})) {
      result = autograd::composed_gradients(
          [&](const variable_list& t) {
            return autograd::normalize_act(t[0], mean, var, t[1], t[2], batch_stats, eps, act, act_param);
          },
          {input, weight, bias}, need, grad_out);
    } else {
      const autograd::BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
      auto [gi, gw, gb] = dispatch::bn_act_backward(
          grad_out, input, mean, var, autograd::optional(weight), autograd::optional(bias), eps,
          kActNames[static_cast<int>(act)], act_param, batch_stats, {need[0], need[1], need[2]});
      result = {gi, gw, gb};
    }
    return autograd::input_gradients_at(ctx, saved.pieces, {0, 1, 2}, result, kArgs);
  }
};

struct BnAct : public torch::autograd::Function<BnAct> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
      c10::string_view act, double act_param) {
    ctx->set_materialize_grads(false);
    at::Tensor out;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      out = dispatch::bn_act(input, mean, var, weight, bias, eps, act, act_param);
    }
    ctx->save_for_backward({input, mean, var, autograd::value(weight), autograd::value(bias)});
    ctx->saved_data["edges"] = autograd::edges(
        {true, true, true, autograd::value(weight).defined(), autograd::value(bias).defined()});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["act"] = static_cast<int64_t>(parse_act(act));
    ctx->saved_data["act_param"] = act_param;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr size_t kArgs = 8;
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(kArgs);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &mean = saved[1], &var = saved[2], &weight = saved[3],
                     &bias = saved[4];
    const double eps = ctx->saved_data["eps"].toDouble();
    const Act act = static_cast<Act>(ctx->saved_data["act"].toInt());
    const double act_param = ctx->saved_data["act_param"].toDouble();
    const auto need = autograd::needed(ctx, {0, 3, 4});
    variable_list result;
    if (autograd::differentiating({grad_out, input, weight, bias})) {
      result = autograd::composed_gradients(
          [&](const variable_list& t) {
            return autograd::normalize_act(t[0], mean, var, t[1], t[2], false, eps, act, act_param);
          },
          {input, weight, bias}, need, grad_out);
    } else {
      const autograd::BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
      auto [gi, gw, gb] = dispatch::bn_act_backward(
          grad_out, input, mean, var, autograd::optional(weight), autograd::optional(bias), eps,
          kActNames[static_cast<int>(act)], act_param, false, {need[0], need[1], need[2]});
      result = {gi, gw, gb};
    }
    return autograd::gradients_at({0, 3, 4}, result, kArgs);
  }
};

at::Tensor bn_act_autograd(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    c10::string_view act, double act_param) {
  return BnAct::apply(input, mean, var, weight, bias, eps, act, act_param);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_act_autograd(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool batch_stats, double eps,
    c10::string_view act, double act_param) {
  auto r = autograd::apply_dropping_marks<BatchNormAct>(
      at::TensorList(), input, weight, bias, running_mean, running_var, batch_stats, eps, act,
      act_param);
  return {r[0], r[1], r[2], r[3]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cat_batch_norm_act_autograd(
    at::TensorList pieces, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool batch_stats, double eps,
    c10::string_view act, double act_param) {
  auto r = autograd::apply_dropping_marks<BatchNormAct>(
      autograd::pieces_of(pieces), input, weight, bias, running_mean, running_var, batch_stats, eps,
      act, act_param);
  return {r[0], r[1], r[2], r[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("batch_norm_act", &batch_norm_act_autograd);
  m.impl("cat_batch_norm_act", &cat_batch_norm_act_autograd);
  m.impl("bn_act", &bn_act_autograd);
}

}  // namespace fxfuse
