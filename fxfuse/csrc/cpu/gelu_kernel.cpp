// Hand-written CPU kernels for gelu and gelu_backward.
//
// This file holds the operator entry points (validation, dtype and layout
// routing, the CPU dispatch-key registration) and the DEFAULT-capability build of
// the kernel bodies; gelu_kernel_avx2.cpp holds the AVX2 build. See
// gelu_kernel.h and gelu_kernel_impl.h for the design.
//
// Routing:
//  * float / double, any non-overlapping and dense layout (contiguous,
//    channels_last, any permutation of them), with grad_output sharing the
//    input's dtype, sizes and strides: the hand-written kernels, which see the
//    data as a flat array;
//  * anything else (half, bfloat16, strided views, broadcast grads, empty
//    tensors, ...): the device-generic implementation, i.e. ATen's own kernel.
// Outputs are allocated as ATen's TensorIterator allocates them for such an
// input, so both paths (and the fake kernels, which run ATen's meta functions)
// agree on strides.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <string>

#include "../activation_ops.h"
#include "gelu_kernel.h"
#include "gelu_kernel_impl.h"

namespace fxfuse {
namespace {

// Whether to run the AVX2 build: the CPU must have AVX2 and FMA, and ATen's own
// CPU capability must be AVX2 or better (ATEN_CPU_CAPABILITY=default lowers it,
// which selects the baseline build here too, as in bn_act_kernel.cpp).
bool use_avx2_kernels() {
#if FXFUSE_HAVE_AVX2_KERNELS
  static const bool ok = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return false;
    const std::string aten = at::get_cpu_capability();  // "NO AVX", "AVX2", "AVX512", ...
    return aten == "AVX2" || aten == "AVX512";
  }();
  return ok;
#else
  return false;
#endif
}

template <typename T>
const cpu::GeluKernelTable<T>& kernel_table() {
#if FXFUSE_HAVE_AVX2_KERNELS
  if (use_avx2_kernels()) return cpu::AVX2::gelu_kernels<T>();
#endif
  return cpu::DEFAULT::gelu_kernels<T>();
}

// Whether the kernels can treat `t` as a flat array of numel() elements.
bool flat_ok(const at::Tensor& t) {
  return (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble) &&
      t.layout() == at::kStrided && t.numel() > 0 && t.is_non_overlapping_and_dense() &&
      !t.is_neg();
}

// The output TensorIterator allocates for an elementwise op whose inputs all have
// t's sizes and strides (its "fast setup"): contiguous, else channels_last(_3d),
// else t's own (dense) strides.
at::Tensor empty_elementwise_like(const at::Tensor& t) {
  if (t.is_contiguous()) return at::empty(t.sizes(), t.options());
  for (auto format : {at::MemoryFormat::ChannelsLast, at::MemoryFormat::ChannelsLast3d}) {
    if (t.is_contiguous(format)) {
      return at::empty(t.sizes(), t.options().memory_format(format));
    }
  }
  return at::empty_strided(t.sizes(), t.strides(), t.options());
}

}  // namespace

at::Tensor gelu_cpu(const at::Tensor& self, c10::string_view approximate) {
  const bool tanh = gelu_is_tanh(approximate, "gelu");
  if (!flat_ok(self)) return gelu_generic(self, approximate);
  at::Tensor out = empty_elementwise_like(self);
  AT_DISPATCH_FLOATING_TYPES(self.scalar_type(), "fxfuse::gelu_cpu", [&] {
    kernel_table<scalar_t>().forward(
        self.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), self.numel(), tanh);
  });
  return out;
}

at::Tensor gelu_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& self, c10::string_view approximate) {
  const bool tanh = gelu_is_tanh(approximate, "gelu_backward");
  if (!flat_ok(self) || !grad_output.device().is_cpu() ||
      grad_output.layout() != at::kStrided ||
      grad_output.scalar_type() != self.scalar_type() || grad_output.is_neg() ||
      grad_output.sizes() != self.sizes() || grad_output.strides() != self.strides()) {
    return gelu_backward_generic(grad_output, self, approximate);
  }
  at::Tensor grad_input = empty_elementwise_like(self);
  AT_DISPATCH_FLOATING_TYPES(self.scalar_type(), "fxfuse::gelu_backward_cpu", [&] {
    kernel_table<scalar_t>().backward(
        grad_output.const_data_ptr<scalar_t>(), self.const_data_ptr<scalar_t>(),
        grad_input.mutable_data_ptr<scalar_t>(), self.numel(), tanh);
  });
  return grad_input;
}

TORCH_LIBRARY_IMPL(fxfuse, CPU, m) {
  m.impl("gelu", &gelu_cpu);
  m.impl("gelu_backward", &gelu_backward_cpu);
}

}  // namespace fxfuse
