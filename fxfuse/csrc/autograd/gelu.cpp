// Autograd kernel of fxfuse::gelu: keeps its input, as eager's GELU does; its backward is
// fxfuse::gelu_backward.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/gelu.h>
#include <torch/library.h>

#include <string>

#include "function.h"

namespace fxfuse {
namespace {

using autograd::AutogradContext;
using autograd::variable_list;

struct Gelu : public torch::autograd::Function<Gelu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& self, c10::string_view approximate) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fxfuse::gelu", "")
                         .typed<decltype(gelu_generic)>();
    ctx->set_materialize_grads(false);
    at::Tensor out;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      out = op.call(self, approximate);
    }
    ctx->save_for_backward({self});
    ctx->saved_data["approximate"] = std::string(approximate);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("fxfuse::gelu_backward", "")
                                  .typed<decltype(gelu_backward_generic)>();
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor self = ctx->get_saved_variables()[0];
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    if (autograd::differentiating({grad_out, self})) {
      const auto result = autograd::composed_gradients(
          [&](const variable_list& t) { return at::gelu(t[0], approximate); }, {self}, {true},
          grad_out);
      return {result[0], at::Tensor()};
    }
    const autograd::BelowAutograd below;  // the backward op's kernel, not autograd's boxed fallback
    return {backward_op.call(grad_out, self, approximate), at::Tensor()};
  }
};

at::Tensor gelu_autograd(const at::Tensor& self, c10::string_view approximate) {
  return Gelu::apply(self, approximate);
}

}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, Autograd, m) {
  m.impl("gelu", &gelu_autograd);
}

}  // namespace fxfuse
