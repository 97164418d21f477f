// Autocast kernel of fxfuse::conv_bn_act (the pattern of torchvision's
// csrc/ops/autocast/*): under torch.autocast, cast what eager autocast casts for
// the convolution (input, weight, bias: conv2d is on autocast's lower-precision
// list) and leave BatchNorm's parameters and running statistics alone (batch_norm
// is on no autocast list: eager runs it on the low-precision conv output with
// float32 parameters, computing statistics in float32). Then call the op again
// with the Autocast key excluded, which reaches its autograd formula, so the
// tensor kept for backward is the low-precision input.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace fxfuse {
namespace {

using Fn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
    at::IntArrayRef, at::IntArrayRef, int64_t, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, bool, double, c10::string_view, double);

template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_bn_act_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    bool batch_stats, double eps, c10::string_view act, double act_param) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fxfuse::conv_bn_act", "")
                       .typed<Fn>();
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  return op.call(
      at::autocast::cached_cast(dt, input, device_type),
      at::autocast::cached_cast(dt, weight, device_type),
      at::autocast::cached_cast(dt, bias, device_type), stride, padding, dilation, groups,
      bn_weight, bn_bias, running_mean, running_var, batch_stats, eps, act, act_param);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, AutocastCPU, m) {
  m.impl(
      "conv_bn_act",
      TORCH_FN((conv_bn_act_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>)));
}

TORCH_LIBRARY_IMPL(fxfuse, AutocastCUDA, m) {
  m.impl(
      "conv_bn_act",
      TORCH_FN((conv_bn_act_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>)));
}

}  // namespace fxfuse
