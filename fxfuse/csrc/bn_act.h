// Shared declarations for the BatchNorm-apply + activation family of ops.
//
// Conventions used by every implementation (generic ATen and hand-written CPU):
//  * "channels" is dim 1 of a 4-D input (N, C, H, W); statistics are per channel.
//  * mean/var are the batch statistics (biased var) or the running statistics;
//    invstd = 1 / sqrt(var + eps) is recomputed from var (the CUDA kernels' C++ entry
//    points, bn_act_kernels.h, also take it as computed by bn_stats_update).
//  * statistic tensors use the op-math dtype: the input dtype for float/double,
//    float32 for half/bfloat16.
//  * outputs keep the input's memory format (contiguous or channels_last).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <string>
#include <tuple>

#include "act.h"

namespace fxfuse {

// The schemas of bn_stats, bn_act, bn_act_backward and their in-place forms (generic/bn_act.cpp)
// and of update_running_stats_ (generic/running_stats.cpp), which the tests' namespaces
// (module.cpp: fxfuse_generic, fxfuse_elementwise) define again.
namespace schemas {
extern const char* const kBnStats;
extern const char* const kBnAct;
extern const char* const kBnActBackward;
extern const char* const kBnActInplace;
extern const char* const kBnActBackwardInplace;
extern const char* const kBnActBackwardIntoGrad;
extern const char* const kUpdateRunningStats;
}  // namespace schemas

// dtype used for statistics of an input of dtype `t`.
at::ScalarType stats_dtype(at::ScalarType t);

// Memory format of a 4-D tensor that the kernels should produce.
at::MemoryFormat suggested_format(const at::Tensor& t);

// ---- device-generic implementations, built from ATen calls ----
// (mean, biased var, unbiased var), the last for the running-statistics update.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_generic(const at::Tensor& input);

// The running-statistics update (update_running_stats_, generic/running_stats.cpp) as ATen calls.
void update_running_stats_generic_(
    at::Tensor& running_mean, at::Tensor& running_var, const at::Tensor& mean,
    const at::Tensor& unbiased_var, double momentum);

// The statistics a BatchNorm applies: the batch's (bn_stats) when batch_stats, else
// copies of the running ones (the running var twice); `op` names the caller in errors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> normalization_stats(
    const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool batch_stats, const char* op);

at::Tensor bn_act_generic(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param);

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_generic(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask);

// In-place forms (ops bn_act_, bn_act_backward_ and bn_act_backward_into_grad_):
// `self` / `input` / `grad_out` is overwritten with the output / grad_input /
// grad_input; output_mask is (weight, bias).
void bn_act_generic_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param);

std::tuple<at::Tensor, at::Tensor> bn_act_backward_generic_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask);

std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_generic_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask);

// ---- hand-written CPU kernels (cpu/bn_act_kernel.cpp) ----
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_cpu(const at::Tensor& input);

at::Tensor bn_act_cpu(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param);

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask);

void bn_act_cpu_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param);

std::tuple<at::Tensor, at::Tensor> bn_act_backward_cpu_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask);

std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_cpu_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask);

// ---- host build of the CUDA kernels' per-element math (cpu/bn_act_elementwise.cpp),
// for the tests; same signatures as bn_act / bn_act_backward / bn_act_ / bn_act_backward_ /
// bn_act_backward_into_grad_ / bn_stats ----
at::Tensor bn_act_elementwise_host(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param);

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_elementwise_host(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask);

void bn_act_elementwise_host_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param);

std::tuple<at::Tensor, at::Tensor> bn_act_backward_elementwise_host_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask);

std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_elementwise_host_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask);

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_elementwise_host(const at::Tensor& input);

void update_running_stats_elementwise_host_(
    at::Tensor& running_mean, at::Tensor& running_var, const at::Tensor& mean,
    const at::Tensor& unbiased_var, double momentum);

// The entry points a C++ caller uses (bn_act_kernels.h), in op form for the tests:
// (mean, invstd, var, unbiased_var) with the running statistics updated in place, and the
// apply / backward kernels given invstd instead of var.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_stats_update_elementwise_host(
    const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps);

at::Tensor bn_act_invstd_elementwise_host(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param);

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_invstd_elementwise_host(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, c10::string_view act, double act_param,
    bool batch_stats, std::array<bool, 3> output_mask);

}  // namespace fxfuse
