// Entry points of the BatchNorm + activation kernels for C++ callers: the CUDA kernels
// (cuda/*.cu, in builds with FXFUSE_WITH_CUDA) and their host build
// (cpu/bn_act_elementwise.cpp), with the same host logic (bn_act_host_setup.h) and the
// same per-channel and per-element math (bn_act_device.h, bn_act_elementwise.h). The host
// logic issues no ATen op but allocations (at::empty*) in the usual case: per-channel
// tensors already in the statistics dtype A (float for half / bfloat16, else the input's),
// contiguous, and grad_out in the input's dtype and layout.
//
// Launches on CUDA, per call:
//   bn_stats_update  2: the split Welford reduction, then a finalize that merges the
//                       splits and writes mean, invstd, var, unbiased var and the running
//                       statistics (eager CUDA's formula, bn_act_device.h);
//   bn_act_apply     1: coefficients from (mean, var or invstd, weight, bias) in the kernel;
//   bn_act_backward_apply
//                    3: the split reduction of sum(g) and sum(g * (x - mean)), a finalize
//                       writing grad_weight, grad_bias and the grad_input coefficients,
//                       the grad_input kernel (1 without a reduction: fixed statistics and
//                       no parameter gradient);
//   update_running_stats_
//                    1.
// So bn_stats + update_running_stats_ + bn_act is 4 forward, bn_act_backward 3 (plus a
// dtype conversion where a per-channel tensor, grad_out or a parameter gradient is in
// another dtype).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "act.h"
#include "bn_act_elementwise.h"

namespace fxfuse {

// The batch's statistics, in A: mean, invstd = 1 / sqrt(var + eps) (undefined when not
// asked for), biased var, and unbiased var = var * M / (M - 1) (as eager's CUDA update).
struct BatchStats {
  at::Tensor mean, invstd, var, unbiased_var;
};

// The kernels of one build (each member is defined by that build's files). Preconditions
// (bn_act_host_setup.h checks them and takes the generic path, on CUDA, or raises, in the
// host build, otherwise): input contiguous NCHW or channels_last (layout L) and non-empty;
// dy and dst of the input's dtype and layout; running statistics contiguous C-vectors in A
// or in the input's dtype.
enum class Build { Cuda, Host };

template <Build B>
struct Kernels {
  static constexpr bool kGenericFallback = B == Build::Cuda;

  static BatchStats stats(
      const at::Tensor& input, const elementwise::Layout& L,
      const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
      double momentum, double eps, bool with_invstd);

  // out = act(bn(input)); spread: var (spread_is_var) or invstd. out may be input.
  static void apply(
      const at::Tensor& input, const elementwise::Layout& L, const at::Tensor& mean,
      const at::Tensor& spread, bool spread_is_var, const std::optional<at::Tensor>& weight,
      const std::optional<at::Tensor>& bias, double eps, Act act, double act_param,
      const at::Tensor& out);

  // (grad_weight, grad_bias) where asked for; grad_input into dst when it is defined (a
  // fresh tensor, input or dy).
  static std::tuple<at::Tensor, at::Tensor> backward(
      const at::Tensor& dy, const at::Tensor& input, const elementwise::Layout& L,
      const at::Tensor& mean, const at::Tensor& spread, bool spread_is_var,
      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
      double eps, Act act, double act_param, bool batch_stats, bool need_weight, bool need_bias,
      const at::Tensor& dst);

  // Eager CUDA's running-statistics update from the batch's mean and unbiased var.
  static void update_running_stats(
      const at::Tensor& running_mean, const at::Tensor& running_var, const at::Tensor& mean,
      const at::Tensor& unbiased_var, double momentum);
};

using CudaKernels = Kernels<Build::Cuda>;
using HostKernels = Kernels<Build::Host>;

// Statistics and the running update in one reduction and one finalize: what a fused
// forward needs before bn_act_apply. running_mean / running_var: both or neither.
BatchStats bn_stats_update_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps);
BatchStats bn_stats_update_host(
    const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps);

}  // namespace fxfuse
