// Device-generic batch_norm_act: the statistics the BN applies (normalization_stats,
// generic/bn_act.cpp), then fxfuse::bn_act through the dispatcher, so that each device runs its
// own bn_stats and bn_act kernels. Registered as CompositeExplicitAutograd: one implementation for
// every device.
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "../bn_act.h"
#include "../cat_input.h"
#include "../checks.h"
#include "../dispatch.h"

namespace fxfuse {

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_act(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool batch_stats, double eps,
    c10::string_view act, double act_param) {
  checks::bn_input(input, "batch_norm_act");
  auto [mean, var, unbiased_var] =
      normalization_stats(input, running_mean, running_var, batch_stats, "batch_norm_act");
  at::Tensor out = dispatch::bn_act(input, mean, var, weight, bias, eps, act, act_param);
  return {out, mean, var, unbiased_var};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  // BatchNorm2d(+activation) that keeps only its input for backward. mean / var: the
  // statistics applied (bn_stats' when batch_stats, else the running ones); unbiased_var:
  // the batch's, for the caller's running-statistics update (the running var otherwise).
  m.def(
      "batch_norm_act(Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, "
      "Tensor? running_var, bool batch_stats, float eps, str act, float act_param) "
      "-> (Tensor out, Tensor mean, Tensor var, Tensor unbiased_var)");
}

constexpr char kBatchNormAct[] = "fxfuse::batch_norm_act";

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("batch_norm_act", &batch_norm_act);
  m.impl("cat_batch_norm_act", &cat_input::Of<decltype(batch_norm_act)>::kernel<kBatchNormAct>);
}

}  // namespace fxfuse
