// Host-side preparation shared by the elementwise BatchNorm-apply + activation
// kernels (CUDA: cuda/bn_act_*.cu; host build: cpu/bn_act_elementwise.cpp): the
// layout the kernels index with, and the per-channel coefficients in the
// arithmetic dtype, computed with ATen ops exactly as bn_act_generic computes them.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <optional>

#include "bn_act.h"
#include "bn_act_elementwise.h"
#include "checks.h"

namespace fxfuse::elementwise {

// The layout of `t` if the kernels handle it (contiguous NCHW or channels_last).
inline std::optional<std::pair<Layout, at::MemoryFormat>> layout_of(const at::Tensor& t) {
  const Layout base{t.size(0), t.size(1), t.size(2) * t.size(3), false};
  if (t.is_contiguous()) return std::make_pair(base, at::MemoryFormat::Contiguous);
  if (t.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    Layout cl = base;
    cl.channels_last = true;
    return std::make_pair(cl, at::MemoryFormat::ChannelsLast);
  }
  return std::nullopt;
}

// Per-channel vectors in the arithmetic dtype (stats_dtype of the input), contiguous.
struct Coefficients {
  at::Tensor mean, invstd, scale, bias;
};

inline Coefficients coefficients(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps) {
  const auto sd = stats_dtype(input.scalar_type());
  const auto opts = input.options().dtype(sd);
  Coefficients cf;
  cf.mean = mean.to(opts).contiguous();
  cf.invstd = (var.to(opts) + eps).rsqrt().contiguous();
  cf.scale = weight.has_value() && weight->defined() ? (cf.invstd * weight->to(opts)).contiguous()
                                                     : cf.invstd;
  cf.bias = bias.has_value() && bias->defined() ? bias->to(opts).contiguous()
                                                : at::zeros({input.size(1)}, opts);
  return cf;
}

}  // namespace fxfuse::elementwise
