// Autograd kernels of fxfuse::avg_pool2d and fxfuse::max_pool2d. Their backward needs only the
// input's geometry (sizes, strides, dtype, device), and max_pool2d's where each maximum lies in
// its window (one byte per output element): neither keeps the input, where eager's keeps it
// (and max_pool2d int64 indices).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/avg_pool2d_backward.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/max_pool2d_with_indices_backward.h>
#include <torch/library.h>

#include <optional>

#include "function.h"

namespace fxfuse {
namespace {

using autograd::AutogradContext;
using autograd::variable_list;

using AvgPool2dFn = at::Tensor(
    const at::Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, bool, bool,
    std::optional<int64_t>);
using MaxPool2dFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, bool);
using MaxPool2dIndicesFn = at::Tensor(
    const at::Tensor&, int64_t, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef);

void save_geometry(AutogradContext* ctx, const at::Tensor& input) {
  auto& data = ctx->saved_data;
  data["sizes"] = input.sizes().vec();
  data["strides"] = input.strides().vec();
  data["dtype"] = static_cast<int64_t>(input.scalar_type());
  data["device"] = input.device();
}

// A tensor with the input's sizes, strides, dtype and device, whose values nothing reads.
at::Tensor shape_only(AutogradContext* ctx) {
  auto& data = ctx->saved_data;
  return at::empty_strided(
      data["sizes"].toIntVector(), data["strides"].toIntVector(),
      at::TensorOptions()
          .dtype(static_cast<at::ScalarType>(data["dtype"].toInt()))
          .device(data["device"].toDevice()));
}

struct AvgPool2d : public torch::autograd::Function<AvgPool2d> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& input, at::IntArrayRef kernel_size,
      at::IntArrayRef stride, at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
      std::optional<int64_t> divisor_override) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("fxfuse::avg_pool2d", "").typed<AvgPool2dFn>();
    ctx->set_materialize_grads(false);
    at::Tensor out;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      out = op.call(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override);
    }
    save_geometry(ctx, input);
    auto& data = ctx->saved_data;
    data["kernel_size"] = kernel_size.vec();
    data["stride"] = stride.vec();
    data["padding"] = padding.vec();
    data["ceil_mode"] = ceil_mode;
    data["count_include_pad"] = count_include_pad;
    data["divisor_override"] = divisor_override;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr size_t kArgs = 7;
    variable_list result(kArgs);
    if (!grads[0].defined()) return result;
    auto& data = ctx->saved_data;
    result[0] = at::avg_pool2d_backward(
        grads[0], shape_only(ctx), data["kernel_size"].toIntVector(), data["stride"].toIntVector(),
        data["padding"].toIntVector(), data["ceil_mode"].toBool(), data["count_include_pad"].toBool(),
        data["divisor_override"].toOptional<int64_t>());
    return result;
  }
};

struct MaxPool2d : public torch::autograd::Function<MaxPool2d> {
  static variable_list forward(
      AutogradContext* ctx, const at::Tensor& input, at::IntArrayRef kernel_size,
      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("fxfuse::max_pool2d", "").typed<MaxPool2dFn>();
    ctx->set_materialize_grads(false);
    at::Tensor out, offsets;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      std::tie(out, offsets) = op.call(input, kernel_size, stride, padding, dilation, ceil_mode);
    }
    ctx->mark_non_differentiable({offsets});
    ctx->save_for_backward({offsets});
    save_geometry(ctx, input);
    auto& data = ctx->saved_data;
    data["kernel_size"] = kernel_size.vec();
    data["stride"] = stride.vec();
    data["padding"] = padding.vec();
    data["dilation"] = dilation.vec();
    data["ceil_mode"] = ceil_mode;
    return {out, offsets};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto indices_op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fxfuse::max_pool2d_indices", "")
                                 .typed<MaxPool2dIndicesFn>();
    constexpr size_t kArgs = 6;
    variable_list result(kArgs);
    if (!grads[0].defined()) return result;
    const at::Tensor offsets = ctx->get_saved_variables()[0];
    auto& data = ctx->saved_data;
    const auto sizes = data["sizes"].toIntVector();
    const auto kernel_size = data["kernel_size"].toIntVector(), stride = data["stride"].toIntVector(),
               padding = data["padding"].toIntVector(), dilation = data["dilation"].toIntVector();
    const at::Tensor indices =
        indices_op.call(offsets, sizes.back(), kernel_size, stride, padding, dilation);
    result[0] = at::max_pool2d_with_indices_backward(
        grads[0], shape_only(ctx), kernel_size, stride, padding, dilation,
        data["ceil_mode"].toBool(), indices);
    return result;
  }
};

at::Tensor avg_pool2d_autograd(
    const at::Tensor& input, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
    std::optional<int64_t> divisor_override) {
  return AvgPool2d::apply(
      input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override);
}

std::tuple<at::Tensor, at::Tensor> max_pool2d_autograd(
    const at::Tensor& input, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  auto r = autograd::apply_dropping_marks<MaxPool2d>(
      input, kernel_size, stride, padding, dilation, ceil_mode);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("avg_pool2d", &avg_pool2d_autograd);
  m.impl("max_pool2d", &max_pool2d_autograd);
}

}  // namespace fxfuse
