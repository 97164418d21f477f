// Host-side preparation shared by the elementwise BatchNorm-apply + activation
// kernels (CUDA: cuda/bn_act_*.cu; host build: cpu/bn_act_elementwise.cpp): the
// layout the kernels index with, and the per-channel coefficients in the
// arithmetic dtype, computed with ATen ops exactly as bn_act_generic computes them.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <optional>
#include <tuple>

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

// The per-channel results of bn_act_backward's reduction, from the raw sums sum(g) and
// sum(g * (x - mean)) over the channel's M elements: sum_g (grad_bias), sum_gx =
// sum(g * xhat) (grad_weight), and with batch statistics k1 = sum_g / M, k2 = sum_gx / M
// for the grad_input pass (undefined otherwise).
struct BackwardSums {
  at::Tensor sum_g, sum_gx, k1, k2;
};

inline BackwardSums backward_sums(
    const at::Tensor& sum_g, const at::Tensor& sum_gxm, const Coefficients& cf, int64_t M,
    bool batch_stats) {
  BackwardSums r{sum_g, sum_gxm * cf.invstd, at::Tensor(), at::Tensor()};
  if (batch_stats) {
    r.k1 = r.sum_g / static_cast<double>(M);
    r.k2 = r.sum_gx / static_cast<double>(M);
  }
  return r;
}

// (grad_weight, grad_bias) from the sums, in the parameters' dtypes, where asked for.
inline std::tuple<at::Tensor, at::Tensor> parameter_grads(
    const BackwardSums& sums, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, bool need_weight, bool need_bias) {
  at::Tensor grad_weight, grad_bias;
  if (need_weight && checks::given(weight)) grad_weight = sums.sum_gx.to(weight->scalar_type());
  if (need_bias && checks::given(bias)) grad_bias = sums.sum_g.to(bias->scalar_type());
  return {grad_weight, grad_bias};
}

// bn_stats' (mean, biased var, unbiased var) from sum((x - mean)^2) over M elements.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_from_squares(
    const at::Tensor& mean, const at::Tensor& sum_sq, int64_t M) {
  return {mean, sum_sq / static_cast<double>(M), sum_sq / static_cast<double>(M - 1)};
}

}  // namespace fxfuse::elementwise
