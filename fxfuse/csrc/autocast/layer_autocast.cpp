// Autocast kernels of the fused ops that contain a convolution or a linear layer (the pattern
// of torchvision's csrc/ops/autocast/*). Under torch.autocast they cast what eager autocast
// casts for that layer (input, weight, bias: conv2d and linear are on autocast's
// lower-precision list; layer_norm on CUDA's float32 list) and leave BatchNorm's parameters and
// running statistics alone
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

// cached_cast's rule: the dtype `t` has once autocast has cast it for a lower-precision op.
template <c10::DeviceType device_type>
at::ScalarType cast_dtype(const at::Tensor& t, at::ScalarType dt) {
  return at::autocast::is_eligible(t, device_type) ? dt : t.scalar_type();
}

// Whether a linear's (already cast) weight and bias agree with an input of `dtype`; where they
// do not (a float64 input with a cast weight, ...), eager's F.linear raises, and so the ops run
// eager's composition, which raises the same error.
bool linear_agrees(
    at::ScalarType dtype, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return weight.scalar_type() == dtype && (!bias.has_value() || !bias->defined() ||
                                           bias->scalar_type() == dtype);
}

// Eager autocast runs the activation in the input's own dtype (no activation is on an autocast
// list) and casts its output for linear. The op is given the uncast input and the cast weight
// and bias, and casts the activation's output to the weight's dtype itself
// (generic/act_linear.cpp), so it keeps the input as eager's activation does, not the cast copy.
template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
at::Tensor act_linear_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  auto cast = [dt](const auto& t) { return at::autocast::cached_cast(dt, t, device_type); };
  const at::Tensor w = cast(weight);
  const auto b = cast(bias);
  if (!linear_agrees(cast_dtype<device_type>(input, dt), w, b)) {
    return at::linear(cast(act_forward(input, parse_act(act), act_param)), w, b);
  }
  return dispatch::act_linear(input, w, b, act, act_param);
}

// Eager's multiply by the scale is on no autocast list (type promotion: a float32 scale gives a
// float32 result); the op multiplies as eager does (generic/act_linear_scale.cpp).
template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
at::Tensor act_linear_scale_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& scale, c10::string_view act, double act_param) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  auto cast = [dt](const auto& t) { return at::autocast::cached_cast(dt, t, device_type); };
  const at::Tensor w = cast(weight);
  const auto b = cast(bias);
  if (!linear_agrees(cast_dtype<device_type>(input, dt), w, b)) {
    return at::linear(cast(act_forward(input, parse_act(act), act_param)), w, b).mul(scale);
  }
  return dispatch::act_linear_scale(input, w, b, scale, act, act_param);
}

// layer_norm is on CUDA autocast's float32 list (its input and parameters cast to float32) and
// on none of CPU autocast's (a bfloat16 input with float32 parameters runs as it is, giving a
// bfloat16 output); linear casts the layer norm's output. The op casts that output to the cast
// weight's dtype itself (generic/layer_norm_linear.cpp) and keeps the layer norm's input, as
// eager's layer norm does (on CUDA its float32 copy, as eager's).
template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
at::Tensor layer_norm_linear_autocast(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& ln_weight, const std::optional<at::Tensor>& ln_bias,
    double eps, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  auto cast = [dt](const auto& t) { return at::autocast::cached_cast(dt, t, device_type); };
  auto norm = [](const auto& t) {
    if constexpr (device_type == c10::DeviceType::CUDA) {
      return at::autocast::cached_cast(at::kFloat, t, device_type);
    } else {
      return t;
    }
  };
  const at::Tensor x = norm(input);
  const auto ln_w = norm(ln_weight);
  const auto ln_b = norm(ln_bias);
  const at::Tensor w = cast(weight);
  const auto b = cast(bias);
  if (!linear_agrees(cast_dtype<device_type>(x, dt), w, b)) {
    return at::linear(cast(at::layer_norm(x, normalized_shape, ln_w, ln_b, eps)), w, b);
  }
  return dispatch::layer_norm_linear(x, normalized_shape, ln_w, ln_b, eps, w, b);
}

// A conv in front: its operands cast as for conv2d. On CPU the op runs whole on the cast
// operands (the layer norm takes the conv's low-precision output as it is). CUDA autocast casts
// the conv output to float32 for the layer norm, a copy between the two that the op does not
// make: there the conv (fxfuse::conv2d) and layer_norm_linear run as two fused ops, and the
// float32 copy is kept, as eager's layer norm keeps it.
template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
at::Tensor conv_layer_norm_linear_autocast(
    const at::Tensor& input, const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& ln_weight,
    const std::optional<at::Tensor>& ln_bias, double eps, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  if constexpr (device_type == c10::DeviceType::CUDA) {
    const at::Tensor z = conv2d_autocast<autocast_key, device_type>(
        input, conv_weight, conv_bias, stride, padding, dilation, groups);
    return layer_norm_linear_autocast<autocast_key, device_type>(
        z.permute({0, 2, 3, 1}), normalized_shape, ln_weight, ln_bias, eps, weight, bias);
  } else {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
    const auto dt = at::autocast::get_autocast_dtype(device_type);
    auto cast = [dt](const auto& t) { return at::autocast::cached_cast(dt, t, device_type); };
    const at::Tensor x = cast(input);
    const at::Tensor cw = cast(conv_weight);
    const auto cb = cast(conv_bias);
    const at::Tensor w = cast(weight);
    const auto b = cast(bias);
    // The conv output has x's dtype (or the conv raises eager's error).
    if (!linear_agrees(cast_dtype<device_type>(x, dt), w, b)) {
      const at::Tensor z =
          at::conv2d(x, cw, cb, stride, padding, dilation, groups).permute({0, 2, 3, 1});
      return at::linear(cast(at::layer_norm(z, normalized_shape, ln_weight, ln_bias, eps)), w, b);
    }
    return dispatch::conv_layer_norm_linear(
        x, cw, cb, stride, padding, dilation, groups, normalized_shape, ln_weight, ln_bias, eps, w,
        b);
  }
}

}  // namespace

#define FXFUSE_REGISTER_AUTOCAST(KEY, DEVICE)                                                   \
  TORCH_LIBRARY_IMPL(fxfuse, KEY, m) {                                                          \
    m.impl("conv_bn_act", TORCH_FN((conv_bn_act_autocast<c10::DispatchKey::KEY, DEVICE>)));    \
    m.impl("conv_act", TORCH_FN((conv_act_autocast<c10::DispatchKey::KEY, DEVICE>)));          \
    m.impl("conv2d", TORCH_FN((conv2d_autocast<c10::DispatchKey::KEY, DEVICE>)));              \
    m.impl("linear_act", TORCH_FN((linear_act_autocast<c10::DispatchKey::KEY, DEVICE>)));      \
    m.impl("act_linear", TORCH_FN((act_linear_autocast<c10::DispatchKey::KEY, DEVICE>)));      \
    m.impl(                                                                                     \
        "layer_norm_linear", TORCH_FN((layer_norm_linear_autocast<c10::DispatchKey::KEY, DEVICE>))); \
    m.impl(                                                                                     \
        "conv_layer_norm_linear",                                                               \
        TORCH_FN((conv_layer_norm_linear_autocast<c10::DispatchKey::KEY, DEVICE>)));            \
    m.impl(                                                                                     \
        "act_linear_scale", TORCH_FN((act_linear_scale_autocast<c10::DispatchKey::KEY, DEVICE>))); \
  }

FXFUSE_REGISTER_AUTOCAST(AutocastCPU, c10::DeviceType::CPU)
FXFUSE_REGISTER_AUTOCAST(AutocastCUDA, c10::DeviceType::CUDA)

}  // namespace fxfuse
