// Hand-written CPU kernels for gelu and gelu_backward.
//
// This file holds the operator entry points (validation, dtype and layout
// routing, the CPU dispatch-key registration) and the DEFAULT-capability build of
// the kernel bodies; gelu_kernel_avx2.cpp holds the AVX2 build. See
// gelu_kernel.h and gelu_kernel_impl.h for the design.
//
// Routing, for a float / double input in any non-overlapping and dense layout
// (contiguous, channels_last, any permutation of them) with grad_output sharing
// its dtype, sizes and strides; the data is processed as a flat array:
//  * float32, erf form, oneDNN enabled: ATen's GELU over a flat (contiguous) view.
//    That is oneDNN's JIT kernel, which F.gelu runs for contiguous float32 input
//    and which is ~1.6x (forward) / ~2.7x (backward) faster than any formulation
//    on at::vec's SLEEF functions; ATen uses it for contiguous input only, the
//    flat view extends it to every dense layout;
//  * otherwise (tanh form, float64, oneDNN disabled): the hand-written kernels,
//    which return exactly what ATen's own GELU kernels return.
// Anything else (half, bfloat16, strided views, broadcast or differently laid out
// grads, empty tensors, ...) takes the device-generic implementation, i.e. ATen's
// own GELU. Outputs are allocated as ATen's TensorIterator allocates them, so both
// paths (and the fake kernels, which run ATen's meta functions) agree on strides.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "../activation_ops.h"
#include "../generic_path.h"
#include "gelu_kernel.h"
#include "gelu_kernel_impl.h"

namespace fxfuse {
namespace {


template <typename T>
const cpu::GeluKernelTable<T>& gelu_kernel_table() {
#if FXFUSE_HAVE_AVX2_KERNELS
  if (cpu::use_avx2_kernels()) return cpu::AVX2::gelu_kernels<T>();
#endif
  return cpu::DEFAULT::gelu_kernels<T>();
}

// Whether the kernels can treat `t` as a flat array of numel() elements.
bool flat_ok(const at::Tensor& t) {
  return (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble) &&
      t.layout() == at::kStrided && t.numel() > 0 && t.is_non_overlapping_and_dense() &&
      !t.is_neg();
}

// Whether ATen runs oneDNN's GELU for a contiguous float32 input (erf form).
bool onednn_gelu() {
  return at::hasMKLDNN() && at::globalContext().userEnabledMkldnn();
}

// A dense tensor as the 1-D contiguous array of its numel() elements in memory order.
at::Tensor flat(const at::Tensor& t) {
  return t.as_strided({t.numel()}, {1});
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

// Calls f(i) for each i with !(|out[i]| < kGeluOverflowCheck), concurrently; returns
// whether there was one. The check vectorizes; f runs only in chunks that need it.
template <typename F>
bool for_each_overflow(const float* out, int64_t n, const F& f) {
  constexpr int64_t kChunk = 16384;
  std::atomic<bool> found{false};
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t b, int64_t e) {
    for (int64_t i0 = b * kChunk; i0 < std::min(n, e * kChunk); i0 += kChunk) {
      const int64_t i1 = std::min(n, i0 + kChunk);
      int any = 0;
      for (int64_t i = i0; i < i1; ++i) any |= !(std::fabs(out[i]) < cpu::kGeluOverflowCheck);
      if (!any) continue;
      found.store(true, std::memory_order_relaxed);
      for (int64_t i = i0; i < i1; ++i) {
        if (!(std::fabs(out[i]) < cpu::kGeluOverflowCheck)) f(i);
      }
    }
  });
  return found.load();
}

}  // namespace

namespace cpu {

void gelu_overflow_as_aten(const float* x, float* out, int64_t n) {
  for_each_overflow(out, n, [&](int64_t i) {
    // GeluKernelImpl's scalar formula; for these inputs (+-inf, NaN, x >= 1e38) its
    // vector formula returns the same: x, +inf or NaN.
    out[i] = x[i] * 0.5f * (1.0f + std::erf(x[i] * static_cast<float>(M_SQRT1_2)));
  });
}

void gelu_overflow_as_onednn(const at::Tensor& out) {
  float* o = out.mutable_data_ptr<float>();
  const int64_t n = out.numel();
  if (!for_each_overflow(o, n, [](int64_t) {})) return;
  std::vector<int64_t> idx;
  std::vector<float> z;
  for (int64_t i = 0; i < n; ++i) {
    if (!(std::fabs(o[i]) < kGeluOverflowCheck) && !std::isnan(o[i])) {  // NaN stays NaN
      idx.push_back(i);
      z.push_back(o[i]);
    }
  }
  if (idx.empty()) return;
  z.push_back(z.back());  // ATen hands oneDNN contiguous input of 2 elements or more
  const at::Tensor g = at::gelu(at::from_blob(z.data(), {static_cast<int64_t>(z.size())}, at::kFloat));
  const float* gp = g.const_data_ptr<float>();
  for (size_t k = 0; k < idx.size(); ++k) o[idx[k]] = gp[k];
}

bool onednn_runs_gelu() { return onednn_gelu(); }

}  // namespace cpu

at::Tensor gelu_cpu(const at::Tensor& self, c10::string_view approximate) {
  const bool tanh = gelu_is_tanh(approximate, "gelu");
  if (!flat_ok(self) || generic_path()) return gelu_generic(self, approximate);
  at::Tensor out = empty_elementwise_like(self);
  if (self.scalar_type() == at::kFloat && !tanh && onednn_gelu()) {
    at::Tensor out_flat = flat(out);
    at::gelu_out(out_flat, flat(self), approximate);
    if (!self.is_contiguous()) {  // eager runs ATen's own kernel here
      cpu::gelu_overflow_as_aten(self.const_data_ptr<float>(), out.mutable_data_ptr<float>(), out.numel());
    }
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES(self.scalar_type(), "fxfuse::gelu_cpu", [&] {
    gelu_kernel_table<scalar_t>().forward(
        self.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), self.numel(), tanh);
  });
  return out;
}

at::Tensor gelu_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& self, c10::string_view approximate) {
  const bool tanh = gelu_is_tanh(approximate, "gelu_backward");
  if (!flat_ok(self) || generic_path() || !grad_output.device().is_cpu() ||
      grad_output.layout() != at::kStrided ||
      grad_output.scalar_type() != self.scalar_type() || grad_output.is_neg() ||
      grad_output.sizes() != self.sizes() || grad_output.strides() != self.strides()) {
    return gelu_backward_generic(grad_output, self, approximate);
  }
  at::Tensor grad_input = empty_elementwise_like(self);
  if (self.scalar_type() == at::kFloat && !tanh && onednn_gelu()) {
    at::Tensor grad_input_flat = flat(grad_input);
    at::gelu_backward_out(grad_input_flat, flat(grad_output), flat(self), approximate);
    return grad_input;
  }
  AT_DISPATCH_FLOATING_TYPES(self.scalar_type(), "fxfuse::gelu_backward_cpu", [&] {
    gelu_kernel_table<scalar_t>().backward(
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
