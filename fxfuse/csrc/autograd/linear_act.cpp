// Autograd kernel of fxfuse::linear_act: keeps input, weight and bias (the backward op
// recomputes the pre-activation).
#include <torch/library.h>

#include "linear_function.h"

namespace fxfuse {
namespace {

struct LinearActTraits {
  static constexpr const char* kName = "fxfuse::linear_act";
  static constexpr const char* kBackward = "fxfuse::linear_act_backward";
  static at::Tensor compose(
      const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, Act act, double act_param) {
    return act_forward(at::linear(x, w, autograd::optional(b)), act, act_param);
  }
};

at::Tensor linear_act_autograd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  return autograd::LinearFunction<LinearActTraits>::apply(input, weight, bias, act, act_param);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("linear_act", &linear_act_autograd);
}

}  // namespace fxfuse
