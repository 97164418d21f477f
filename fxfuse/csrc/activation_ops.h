// Activations as ATen calls, shared by the device-generic implementations of the
// fused ops (bn_act, linear_act, conv_act), and the declarations of the GELU and
// linear/conv + activation op family.
//
// The activation names and the Act enum are those of act.h (act_param is
// leaky_relu's negative_slope and ignored by the others). Each activation is the
// ATen op that eager PyTorch runs for it (F.relu6 is hardtanh(z, 0, 6), ...), so
// the fused ops compute exactly what the eager composition computes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/hardswish.h>
#include <ATen/ops/hardswish_backward.h>
#include <ATen/ops/hardtanh.h>
#include <ATen/ops/hardtanh_backward.h>
#include <ATen/ops/leaky_relu.h>
#include <ATen/ops/leaky_relu_backward.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <ATen/ops/threshold_backward.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "bn_act.h"

namespace fxfuse {

// Parses the activation name used in the op schemas (act.h's kActNames); an unknown
// name is a ValueError, worded as fxfuse.ops.checks.check_act words it.
inline Act parse_act(c10::string_view name) {
  for (int i = 0; i < kNumActs; ++i) {
    if (name == kActNames[i]) return static_cast<Act>(i);
  }
  std::string expected;
  for (const char* known : kActNames) expected += (expected.empty() ? "" : ", ") + std::string(known);
  TORCH_CHECK_VALUE(false, "fxfuse: unknown activation '", name, "'; expected one of ", expected);
}

// act(z), out of place.
inline at::Tensor act_forward(const at::Tensor& z, Act act, double param) {
  switch (act) {
    case Act::None: return z;
    case Act::ReLU: return at::relu(z);
    case Act::ReLU6: return at::hardtanh(z, 0, 6);
    case Act::LeakyReLU: return at::leaky_relu(z, param);
    case Act::GELU: return at::gelu(z, "none");
    case Act::GELUTanh: return at::gelu(z, "tanh");
    case Act::SiLU: return at::silu(z);
    case Act::Hardswish: return at::hardswish(z);
  }
  TORCH_INTERNAL_ASSERT(false, "fxfuse: unhandled activation");
}

// act(z) written over z; same values as act_forward. Only for a temporary that
// nothing else refers to (e.g. a freshly computed pre-activation).
inline at::Tensor act_forward_(at::Tensor& z, Act act, double param) {
  switch (act) {
    case Act::None: return z;
    case Act::ReLU: return at::relu_(z);
    case Act::ReLU6: return at::hardtanh_(z, 0, 6);
    case Act::LeakyReLU: return at::leaky_relu_(z, param);
    case Act::GELU: return at::gelu_(z, "none");
    case Act::GELUTanh: return at::gelu_(z, "tanh");
    case Act::SiLU: return at::silu_(z);
    case Act::Hardswish: return at::hardswish_(z);
  }
  TORCH_INTERNAL_ASSERT(false, "fxfuse: unhandled activation");
}

// grad * act'(z), with z the pre-activation.
inline at::Tensor act_backward(const at::Tensor& grad, const at::Tensor& z, Act act, double param) {
  switch (act) {
    case Act::None: return grad;
    case Act::ReLU: return at::threshold_backward(grad, z, 0);
    case Act::ReLU6: return at::hardtanh_backward(grad, z, 0, 6);
    case Act::LeakyReLU: return at::leaky_relu_backward(grad, z, param, false);
    case Act::GELU: return at::gelu_backward(grad, z, "none");
    case Act::GELUTanh: return at::gelu_backward(grad, z, "tanh");
    case Act::SiLU: return at::silu_backward(grad, z);
    case Act::Hardswish: return at::hardswish_backward(grad, z);
  }
  TORCH_INTERNAL_ASSERT(false, "fxfuse: unhandled activation");
}

// grad * act'(z) written into `out`, which may be grad or z itself (elementwise: each
// element is read before it is written); same values as act_backward. Act::None copies.
inline void act_backward_into(
    at::Tensor& out, const at::Tensor& grad, const at::Tensor& z, Act act, double param) {
  switch (act) {
    case Act::None: out.copy_(grad); return;
    case Act::ReLU: at::threshold_backward_out(out, grad, z, 0); return;
    case Act::ReLU6: at::hardtanh_backward_out(out, grad, z, 0, 6); return;
    case Act::LeakyReLU: at::leaky_relu_backward_out(out, grad, z, param, false); return;
    case Act::GELU: at::gelu_backward_out(out, grad, z, "none"); return;
    case Act::GELUTanh: at::gelu_backward_out(out, grad, z, "tanh"); return;
    case Act::SiLU: at::silu_backward_out(out, grad, z); return;
    case Act::Hardswish: at::hardswish_backward_out(out, grad, z); return;
  }
  TORCH_INTERNAL_ASSERT(false, "fxfuse: unhandled activation");
}

// ---- gelu / gelu_backward ----
// Parses GELU's `approximate` argument: false for "none" (erf form), true for
// "tanh". Anything else raises the RuntimeError that at::gelu raises.
bool gelu_is_tanh(c10::string_view approximate, const char* op);

// The schemas of gelu and gelu_backward (generic/gelu.cpp), which torch.ops.fxfuse_generic
// (module.cpp) defines again.
namespace schemas {
extern const char* const kGelu;
extern const char* const kGeluBackward;
}  // namespace schemas

// Device-generic implementations (generic/gelu.cpp).
at::Tensor gelu_generic(const at::Tensor& self, c10::string_view approximate);
at::Tensor gelu_backward_generic(
    const at::Tensor& grad_output, const at::Tensor& self, c10::string_view approximate);

// Hand-written CPU kernels (cpu/gelu_kernel.cpp).
at::Tensor gelu_cpu(const at::Tensor& self, c10::string_view approximate);
at::Tensor gelu_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& self, c10::string_view approximate);

// ---- linear_act / act_linear / conv_act (generic/linear_act.cpp, act_linear.cpp, conv_act.cpp) ----
// act(linear(input, weight, bias)) and its backward, which recomputes linear(...).
at::Tensor linear_act(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param);

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_act_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, c10::string_view act, double act_param,
    std::array<bool, 3> output_mask);

// linear(act(input), weight, bias) and its backward, which recomputes act(input).
at::Tensor act_linear(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param);

std::tuple<at::Tensor, at::Tensor, at::Tensor> act_linear_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, c10::string_view act, double act_param,
    std::array<bool, 3> output_mask);

// act(conv2d(input, weight, bias, ...)) and its backward, which recomputes conv2d(...).
at::Tensor conv_act(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    c10::string_view act, double act_param);

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_act_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, c10::string_view act, double act_param,
    std::array<bool, 3> output_mask);

}  // namespace fxfuse
