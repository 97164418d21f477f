// Autocast kernels of the fused ops that contain a convolution or a linear layer (the pattern
// of torchvision's csrc/ops/autocast/*). Under torch.autocast they cast what eager autocast
// casts for that layer (input, weight, bias: conv2d and linear are on autocast's
// lower-precision list) and leave BatchNorm's parameters and running statistics alone
// (batch_norm is on no autocast list: eager runs it on the low-precision conv output with
// float32 parameters, computing statistics in float32). Then they call the op again with the
// Autocast key excluded, which reaches its autograd formula, so the tensor kept for backward
// is the low-precision input.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <ATen/ops/conv2d.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>

#include "../activation_ops.h"
#include "../dispatch.h"

namespace fxfuse {
namespace {

template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_act_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    bool batch_stats, double eps, c10::string_view act, double act_param) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  auto cast = [dt](const auto& t) { return at::autocast::cached_cast(dt, t, device_type); };
  return dispatch::conv_bn_act(
      cast(input), cast(weight), cast(bias), stride, padding, dilation, groups, bn_weight, bn_bias,
      running_mean, running_var, batch_stats, eps, act, act_param);
}

template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
at::Tensor conv_act_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    c10::string_view act, double act_param) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  auto cast = [dt](const auto& t) { return at::autocast::cached_cast(dt, t, device_type); };
  return dispatch::conv_act(
      cast(input), cast(weight), cast(bias), stride, padding, dilation, groups, act, act_param);
}

template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
at::Tensor conv2d_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  auto cast = [dt](const auto& t) { return at::autocast::cached_cast(dt, t, device_type); };
  return dispatch::conv2d(cast(input), cast(weight), cast(bias), stride, padding, dilation, groups);
}

template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
at::Tensor linear_act_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  auto cast = [dt](const auto& t) { return at::autocast::cached_cast(dt, t, device_type); };
  return dispatch::linear_act(cast(input), cast(weight), cast(bias), act, act_param);
}

// Eager autocast runs the activation in the input's own dtype (no activation is on an autocast
// list) and then casts its output for linear. Casting the input first would round it before the
// activation, so an input that autocast would cast takes the eager composition (eager's memory
// too); an input already in the autocast dtype (the usual case: a linear's output) or one
// autocast leaves alone (float64) takes the fused op with the weight and bias cast as for linear.
template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
at::Tensor act_linear_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  auto cast = [dt](const auto& t) { return at::autocast::cached_cast(dt, t, device_type); };
  if (at::autocast::is_eligible(input, device_type) && input.scalar_type() != dt) {  // cached_cast's rule
    return at::linear(
        cast(act_forward(input, parse_act(act), act_param)), cast(weight), cast(bias));
  }
  return dispatch::act_linear(input, cast(weight), cast(bias), act, act_param);
}

// Eager autocast runs layer_norm in float32 and casts its output to the autocast dtype for
// linear, a rounding in between that the fused op does not make. So under autocast the op
// is eager's composition, dispatched through autocast again (eager's memory too).
at::Tensor layer_norm_linear_autocast(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
    double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return at::linear(at::layer_norm(input, normalized_shape, ln_weight, ln_bias, eps), weight, bias);
}

// The same for a conv in front: eager's composition, dispatched through autocast again.
at::Tensor conv_layer_norm_linear_autocast(
    const at::Tensor& input, const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& ln_weight,
    const std::optional<at::Tensor>& ln_bias, double eps, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const at::Tensor z =
      at::conv2d(input, conv_weight, conv_bias, stride, padding, dilation, groups).permute({0, 2, 3, 1});
  return layer_norm_linear_autocast(z, normalized_shape, ln_weight, ln_bias, eps, weight, bias);
}

// Eager multiplies act_linear's autocast output by the scale outside any autocast list (type
// promotion: a float32 scale gives a float32 result), so under autocast the op is that
// composition, with act_linear dispatched through autocast again.
at::Tensor act_linear_scale_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& scale, c10::string_view act, double act_param) {
  return dispatch::act_linear(input, weight, bias, act, act_param).mul(scale);
}

}  // namespace

#define FXFUSE_REGISTER_AUTOCAST(KEY, DEVICE)                                                   \
  TORCH_LIBRARY_IMPL(fxfuse, KEY, m) {                                                          \
    m.impl("conv_bn_act", TORCH_FN((conv_bn_act_autocast<c10::DispatchKey::KEY, DEVICE>)));    \
    m.impl("conv_act", TORCH_FN((conv_act_autocast<c10::DispatchKey::KEY, DEVICE>)));          \
    m.impl("conv2d", TORCH_FN((conv2d_autocast<c10::DispatchKey::KEY, DEVICE>)));              \
    m.impl("linear_act", TORCH_FN((linear_act_autocast<c10::DispatchKey::KEY, DEVICE>)));      \
    m.impl("act_linear", TORCH_FN((act_linear_autocast<c10::DispatchKey::KEY, DEVICE>)));      \
    m.impl("layer_norm_linear", TORCH_FN(layer_norm_linear_autocast));                          \
    m.impl("conv_layer_norm_linear", TORCH_FN(conv_layer_norm_linear_autocast));                \
    m.impl("act_linear_scale", TORCH_FN(act_linear_scale_autocast));                            \
  }

FXFUSE_REGISTER_AUTOCAST(AutocastCPU, c10::DeviceType::CPU)
FXFUSE_REGISTER_AUTOCAST(AutocastCUDA, c10::DeviceType::CUDA)

}  // namespace fxfuse
