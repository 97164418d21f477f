// Device-generic gelu / gelu_backward: ATen's own kernels. Registered as
// CompositeExplicitAutograd, so they serve CUDA and every other device, and on CPU
// they are the path the hand-written kernels (cpu/gelu_kernel.cpp) fall back to
// for dtypes and layouts they do not handle (half, bfloat16, strided views, ...).
#include <torch/library.h>

#include "../activation_ops.h"

namespace fxfuse {

bool gelu_is_tanh(c10::string_view approximate, const char* op) {
  if (approximate == "none") return false;
  if (approximate == "tanh") return true;
  TORCH_CHECK(
      false, "fxfuse::", op, ": approximate argument must be either none or tanh, got '",
      approximate, "'");
}

at::Tensor gelu_generic(const at::Tensor& self, c10::string_view approximate) {
  gelu_is_tanh(approximate, "gelu");
  return at::gelu(self, approximate);
}

at::Tensor gelu_backward_generic(
    const at::Tensor& grad_output, const at::Tensor& self, c10::string_view approximate) {
  gelu_is_tanh(approximate, "gelu_backward");
  return at::gelu_backward(grad_output, self, approximate);
}

namespace schemas {
const char* const kGelu = "gelu(Tensor self, *, str approximate='none') -> Tensor";
const char* const kGeluBackward =
    "gelu_backward(Tensor grad_output, Tensor self, *, str approximate='none') -> Tensor";
}  // namespace schemas

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // F.gelu and aten::gelu_backward (approximate: "none" or "tanh").
  m.def(schemas::kGelu);
  m.def(schemas::kGeluBackward);
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("gelu", &gelu_generic);
  m.impl("gelu_backward", &gelu_backward_generic);
}

}  // namespace fxfuse
