// Device-generic update_running_stats_, the running-statistics update of the BN ops (batch_norm_act,
// conv_bn_act, bn_act_conv), as ATen calls; CPU and CUDA have kernels of their own
// (cpu/bn_act_kernel.cpp, cuda/bn_stats_kernel.cu).
#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rsub.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <utility>

#include "../bn_act.h"

namespace fxfuse {

// The ATen calls of fxfuse/ops/running_stats.py's update_running_stats, which says how they
// round as eager's CPU batch_norm rounds its update: one dispatch from Python instead of
// fifteen (33 against 22 us a call, 120 calls a DenseNet-121 train step).
void update_running_stats_generic_(
    at::Tensor& running_mean, at::Tensor& running_var, const at::Tensor& mean,
    const at::Tensor& unbiased_var, double momentum) {
  if (running_mean.scalar_type() == at::kHalf) {
    for (auto [running, batch] : {std::pair{&running_mean, &mean}, std::pair{&running_var, &unbiased_var}}) {
      running->copy_(at::add(
          at::mul(batch->to(at::kDouble), momentum), at::mul(running->to(at::kDouble), 1 - momentum)));
    }
    return;
  }
  const at::Tensor m =
      at::scalar_tensor(momentum, at::TensorOptions().dtype(running_mean.scalar_type()));
  running_mean.copy_(at::add(at::mul(m, mean), at::mul(at::rsub(m, 1), running_mean)));
  const at::Tensor var_term = at::mul(m.to(at::kDouble), unbiased_var.to(at::kDouble));
  const at::Tensor kept = at::mul(at::rsub(m.to(running_var.scalar_type()), 1), running_var);
  running_var.copy_(at::add(var_term, kept.to(at::kDouble)));
}

namespace schemas {
const char* const kUpdateRunningStats =
    "update_running_stats_(Tensor(a!) running_mean, Tensor(b!) running_var, Tensor mean, "
    "Tensor unbiased_var, float momentum) -> ()";
}  // namespace schemas

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // The running-statistics update eager's batch_norm makes on the device (CPU's rounding on
  // CPU, CUDA's on CUDA), from the batch's mean and unbiased var: what the fused ops'
  // callers apply after the op (ops/running_stats.py).
  m.def(schemas::kUpdateRunningStats);
}

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("update_running_stats_", &update_running_stats_generic_);
}

}  // namespace fxfuse
