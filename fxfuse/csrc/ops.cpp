// Every fxfuse operator schema, in one place. Kernels live next door:
//   generic/*.cpp  device-generic implementations from ATen calls
//                  (CompositeExplicitAutograd: CUDA and every other device),
//   cpu/*.cpp      hand-written CPU kernels,
//   cuda/*.cu      CUDA kernels (built with FXFUSE_CUDA=1),
//   autocast/*.cpp Autocast kernels: the casts eager autocast applies, then the op.
// Autograd and fake (meta) kernels are registered from Python (fxfuse/ops/).
#include <torch/extension.h>
#include <torch/library.h>

#include "activation_ops.h"
#include "bn_act.h"

TORCH_LIBRARY(fxfuse, m) {
  // Per-channel batch statistics of a 4-D tensor: (mean, biased var).
  m.def("bn_stats(Tensor input) -> (Tensor mean, Tensor var)");
  // act(batch_norm_apply(input)) with the given statistics.
  m.def(
      "bn_act(Tensor input, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, "
      "float eps, str act, float act_param) -> Tensor");
  m.def(
      "bn_act_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor var, "
      "Tensor? weight, Tensor? bias, float eps, str act, float act_param, "
      "bool batch_stats, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // In-place forms for composites that own the tensor: bn_act_ overwrites self with
  // bn_act(self, ...); bn_act_backward_ overwrites input with grad_input and returns
  // the parameter gradients (output_mask: weight, bias). Same numerics as above.
  m.def(
      "bn_act_(Tensor(a!) self, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, "
      "float eps, str act, float act_param) -> ()");
  m.def(
      "bn_act_backward_(Tensor grad_out, Tensor(a!) input, Tensor mean, Tensor var, "
      "Tensor? weight, Tensor? bias, float eps, str act, float act_param, "
      "bool batch_stats, bool[2] output_mask) -> (Tensor grad_weight, Tensor grad_bias)");
  // BatchNorm2d(+activation) that keeps only its input for backward.
  m.def(
      "batch_norm_act(Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, "
      "Tensor? running_var, bool batch_stats, float eps, str act, float act_param) "
      "-> (Tensor out, Tensor mean, Tensor var)");
  // Conv2d -> BatchNorm2d (-> activation) that keeps only the conv input.
  m.def(
      "conv_bn_act(Tensor input, Tensor weight, Tensor? bias, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups, Tensor? bn_weight, Tensor? bn_bias, "
      "Tensor? running_mean, Tensor? running_var, bool batch_stats, float eps, str act, "
      "float act_param) -> (Tensor out, Tensor mean, Tensor var)");
  m.def(
      "conv_bn_act_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "int[2] stride, int[2] padding, int[2] dilation, int groups, Tensor? bn_weight, "
      "Tensor? bn_bias, Tensor mean, Tensor var, bool batch_stats, float eps, str act, "
      "float act_param, bool[5] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias, "
      "Tensor grad_bn_weight, Tensor grad_bn_bias)");
  // F.gelu and aten::gelu_backward (approximate: "none" or "tanh").
  m.def("gelu(Tensor self, *, str approximate='none') -> Tensor");
  m.def(
      "gelu_backward(Tensor grad_output, Tensor self, *, str approximate='none') -> Tensor");
  // act(F.linear(input, weight, bias)) that keeps only input, weight and bias for backward.
  m.def(
      "linear_act(Tensor input, Tensor weight, Tensor? bias, str act, float act_param) "
      "-> Tensor");
  m.def(
      "linear_act_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "str act, float act_param, bool[3] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // act(F.conv2d(input, weight, bias, ...)) that keeps only input, weight and bias.
  m.def(
      "conv_act(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, str act, float act_param) -> Tensor");
  m.def(
      "conv_act_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "int[2] stride, int[2] padding, int[2] dilation, int groups, str act, float act_param, "
      "bool[3] output_mask) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}

// The device-generic kernels are also exposed directly so that the tests can
// run them on CPU, where the dispatcher would pick the hand-written kernels.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fxfuse C++ operators (loaded for their torch.library registrations)";
  m.def("generic_bn_stats", &fxfuse::bn_stats_generic);
  m.def("generic_bn_act", &fxfuse::bn_act_generic);
  m.def(
      "generic_bn_act_backward",
      [](const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
         const at::Tensor& var, const std::optional<at::Tensor>& weight,
         const std::optional<at::Tensor>& bias, double eps, const std::string& act,
         double act_param, bool batch_stats, std::array<bool, 3> mask) {
        return fxfuse::bn_act_backward_generic(
            grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, mask);
      });
  m.def("generic_bn_act_", &fxfuse::bn_act_generic_);
  m.def(
      "generic_bn_act_backward_",
      [](const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
         const at::Tensor& var, const std::optional<at::Tensor>& weight,
         const std::optional<at::Tensor>& bias, double eps, const std::string& act,
         double act_param, bool batch_stats, std::array<bool, 2> mask) {
        return fxfuse::bn_act_backward_generic_(
            grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, mask);
      });
  // The CUDA kernels' per-element math, built for the host (cpu/bn_act_elementwise.cpp).
  m.def("elementwise_bn_act", &fxfuse::bn_act_elementwise_host);
  m.def(
      "elementwise_bn_act_backward",
      [](const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
         const at::Tensor& var, const std::optional<at::Tensor>& weight,
         const std::optional<at::Tensor>& bias, double eps, const std::string& act,
         double act_param, bool batch_stats, std::array<bool, 3> mask) {
        return fxfuse::bn_act_backward_elementwise_host(
            grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, mask);
      });
  m.def(
      "generic_gelu", &fxfuse::gelu_generic, py::arg("self"), py::kw_only(),
      py::arg("approximate") = "none");
  m.def(
      "generic_gelu_backward", &fxfuse::gelu_backward_generic, py::arg("grad_output"),
      py::arg("self"), py::kw_only(), py::arg("approximate") = "none");
}
