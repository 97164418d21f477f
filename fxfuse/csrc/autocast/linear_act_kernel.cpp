// Autocast kernel of fxfuse::linear_act: casts input, weight and bias as eager
// autocast casts them for linear (lower-precision list), then calls the op again
// with the Autocast key excluded. See conv_bn_act_kernel.cpp.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace fxfuse {
namespace {

using Fn = at::Tensor(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
    double);

template <c10::DispatchKey autocast_key, c10::DeviceType device_type>
at::Tensor linear_act_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fxfuse::linear_act", "").typed<Fn>();
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  return op.call(
      at::autocast::cached_cast(dt, input, device_type),
      at::autocast::cached_cast(dt, weight, device_type),
      at::autocast::cached_cast(dt, bias, device_type), act, act_param);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, AutocastCPU, m) {
  m.impl(
      "linear_act",
      TORCH_FN((linear_act_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>)));
}

TORCH_LIBRARY_IMPL(fxfuse, AutocastCUDA, m) {
  m.impl(
      "linear_act",
      TORCH_FN((linear_act_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>)));
}

}  // namespace fxfuse
