// Calls into fxfuse's own ops through the dispatcher: composite ops (conv_bn_act,
// batch_norm_act) reach the device's best kernel this way, and the Autocast kernels
// (autocast/*.cpp) call the op again below the Autocast key. One wrapper per op, each
// looking its schema up once.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include "bn_act.h"
#include "conv_ops.h"

namespace fxfuse::dispatch {

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats(const at::Tensor& input) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::bn_stats", "")
                       .typed<decltype(bn_stats_generic)>();
  return op.call(input);
}

inline at::Tensor bn_act(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::bn_act", "")
                       .typed<decltype(bn_act_generic)>();
  return op.call(input, mean, var, weight, bias, eps, act, act_param);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::bn_act_backward", "")
                       .typed<decltype(bn_act_backward_generic)>();
  return op.call(
      grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask);
}

inline void bn_act_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::bn_act_", "")
                       .typed<decltype(bn_act_generic_)>();
  op.call(self, mean, var, weight, bias, eps, act, act_param);
}

inline std::tuple<at::Tensor, at::Tensor> bn_act_backward_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::bn_act_backward_", "")
                       .typed<decltype(bn_act_backward_generic_)>();
  return op.call(
      grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask);
}

inline std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::bn_act_backward_into_grad_", "")
                       .typed<decltype(bn_act_backward_into_grad_generic_)>();
  return op.call(
      grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_act(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    bool batch_stats, double eps, c10::string_view act, double act_param) {
  using Fn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
      at::IntArrayRef, at::IntArrayRef, int64_t, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, bool, double, c10::string_view, double);
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fxfuse::conv_bn_act", "").typed<Fn>();
  return op.call(
      input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias, running_mean,
      running_var, batch_stats, eps, act, act_param);
}

inline at::Tensor conv_act(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    c10::string_view act, double act_param) {
  using Fn = at::Tensor(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
      at::IntArrayRef, at::IntArrayRef, int64_t, c10::string_view, double);
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fxfuse::conv_act", "").typed<Fn>();
  return op.call(input, weight, bias, stride, padding, dilation, groups, act, act_param);
}

// linear_act and act_linear share one schema: (input, weight, bias, act, act_param) -> Tensor.
inline at::Tensor linear_family(
    const c10::OperatorHandle& handle, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, c10::string_view act, double act_param) {
  using Fn = at::Tensor(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
      double);
  return handle.typed<Fn>().call(input, weight, bias, act, act_param);
}

inline at::Tensor linear_act(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fxfuse::linear_act", "");
  return linear_family(op, input, weight, bias, act, act_param);
}

inline at::Tensor act_linear(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fxfuse::act_linear", "");
  return linear_family(op, input, weight, bias, act, act_param);
}

inline at::Tensor act_linear_scale(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& scale, c10::string_view act, double act_param) {
  using Fn = at::Tensor(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
      c10::string_view, double);
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fxfuse::act_linear_scale", "").typed<Fn>();
  return op.call(input, weight, bias, scale, act, act_param);
}

inline at::Tensor layer_norm_linear(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
    double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  using Fn = at::Tensor(
      const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, double, const at::Tensor&, const std::optional<at::Tensor>&);
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fxfuse::layer_norm_linear", "").typed<Fn>();
  return op.call(input, normalized_shape, ln_weight, ln_bias, eps, weight, bias);
}

inline at::Tensor conv_layer_norm_linear(
    const at::Tensor& input, const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& ln_weight,
    const std::optional<at::Tensor>& ln_bias, double eps, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  using Fn = at::Tensor(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
      at::IntArrayRef, at::IntArrayRef, int64_t, at::IntArrayRef, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, double, const at::Tensor&, const std::optional<at::Tensor>&);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::conv_layer_norm_linear", "")
                       .typed<Fn>();
  return op.call(
      input, conv_weight, conv_bias, stride, padding, dilation, groups, normalized_shape, ln_weight,
      ln_bias, eps, weight, bias);
}

inline at::Tensor conv2d(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::conv2d", "")
                       .typed<decltype(conv2d_generic)>();
  return op.call(input, weight, bias, stride, padding, dilation, groups);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::conv2d_backward", "")
                       .typed<decltype(conv2d_backward_generic)>();
  return op.call(grad_out, input, weight, bias, stride, padding, dilation, groups, output_mask);
}

}  // namespace fxfuse::dispatch
