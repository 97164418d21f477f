// Device-generic avg_pool2d: ATen's average pooling, bit for bit. What makes the op worth having
// is its autograd (ops/avg_pool2d.py), which keeps none of the input for backward.
#include <ATen/ops/avg_pool2d.h>
#include <torch/library.h>

#include <optional>

namespace fxfuse {

at::Tensor avg_pool2d_generic(
    const at::Tensor& input, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
    std::optional<int64_t> divisor_override) {
  return at::avg_pool2d(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override);
}

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // F.avg_pool2d, whose backward needs only its input's shape, dtype and strides: its autograd
  // (ops/avg_pool2d.py) keeps none of the input, where eager's keeps all of it.
  m.def(
      "avg_pool2d(Tensor input, int[2] kernel_size, int[2] stride, int[2] padding, "
      "bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor");
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("avg_pool2d", &avg_pool2d_generic);
}

}  // namespace fxfuse
