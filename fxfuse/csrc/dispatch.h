// Calls into fxfuse's own ops through the dispatcher, so that composite ops
// (conv_bn_act, batch_norm_act) pick up the device's best kernel.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include "bn_act.h"

namespace fxfuse::dispatch {

inline std::tuple<at::Tensor, at::Tensor> bn_stats(const at::Tensor& input) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::bn_stats", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>();
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

}  // namespace fxfuse::dispatch
