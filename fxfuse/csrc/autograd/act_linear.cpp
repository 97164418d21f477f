// Autograd kernel of fxfuse::act_linear: keeps input, weight and bias (the backward op
// recomputes the activation). Its composition casts the activation's output to the linear's
// dtype, the form the Autocast kernels call it in.
#include <torch/library.h>

#include "linear_function.h"

namespace fxfuse {
namespace {

struct ActLinearTraits {
  static constexpr const char* kName = "fxfuse::act_linear";
  static constexpr const char* kBackward = "fxfuse::act_linear_backward";
  static at::Tensor compose(
      const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, Act act, double act_param) {
    return at::linear(act_forward(x, act, act_param).to(w.scalar_type()), w, autograd::optional(b));
  }
};

at::Tensor act_linear_autograd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  return autograd::LinearFunction<ActLinearTraits>::apply(input, weight, bias, act, act_param);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("act_linear", &act_linear_autograd);
}

}  // namespace fxfuse
