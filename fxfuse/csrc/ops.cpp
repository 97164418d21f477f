// Every fxfuse operator schema, in one place. Kernels live next door:
//   generic/*.cpp  device-generic implementations from ATen calls
//                  (CompositeExplicitAutograd: CUDA and every other device),
//   cpu/*.cpp      hand-written CPU kernels,
//   cuda/*.cu      CUDA kernels (built with FXFUSE_CUDA=1),
//   autocast/*.cpp Autocast kernels: the casts eager autocast applies, then the op,
//   autograd/*.cpp every op's Autograd kernel: torch::autograd::Function, no Python per call.
// Every fake (meta) kernel, and the Autograd kernels of the cat_ forms, are registered from
// Python (fxfuse/ops/).
#include <Python.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "activation_ops.h"
#include "bn_act.h"
#include "cpu/capability.h"
#include "direct_calls.h"
#include "generic_path.h"

namespace fxfuse {
namespace {
std::atomic<bool> generic_path_flag{[] {
  const char* v = std::getenv("FXFUSE_GENERIC");
  return v != nullptr && std::strcmp(v, "1") == 0;
}()};
}  // namespace

bool generic_path() { return generic_path_flag.load(std::memory_order_relaxed); }

bool set_generic_path(bool enabled) { return generic_path_flag.exchange(enabled); }
}  // namespace fxfuse

namespace {
// Schemas that the test-only namespaces at the end share with torch.ops.fxfuse.
constexpr const char* kBnStats =
    "bn_stats(Tensor input) -> (Tensor mean, Tensor var, Tensor unbiased_var)";
constexpr const char* kBnAct =
    "bn_act(Tensor input, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, "
    "float eps, str act, float act_param) -> Tensor";
constexpr const char* kBnActBackward =
    "bn_act_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor var, "
    "Tensor? weight, Tensor? bias, float eps, str act, float act_param, "
    "bool batch_stats, bool[3] output_mask) -> (Tensor, Tensor, Tensor)";
constexpr const char* kBnActInplace =
    "bn_act_(Tensor(a!) self, Tensor mean, Tensor var, Tensor? weight, Tensor? bias, "
    "float eps, str act, float act_param) -> ()";
constexpr const char* kBnActBackwardInplace =
    "bn_act_backward_(Tensor grad_out, Tensor(a!) input, Tensor mean, Tensor var, "
    "Tensor? weight, Tensor? bias, float eps, str act, float act_param, "
    "bool batch_stats, bool[2] output_mask) -> (Tensor grad_weight, Tensor grad_bias)";
constexpr const char* kBnActBackwardIntoGrad =
    "bn_act_backward_into_grad_(Tensor(a!) grad_out, Tensor input, Tensor mean, Tensor var, "
    "Tensor? weight, Tensor? bias, float eps, str act, float act_param, "
    "bool batch_stats, bool[2] output_mask) -> (Tensor grad_weight, Tensor grad_bias)";
constexpr const char* kUpdateRunningStats =
    "update_running_stats_(Tensor(a!) running_mean, Tensor(b!) running_var, Tensor mean, "
    "Tensor unbiased_var, float momentum) -> ()";
constexpr const char* kGelu = "gelu(Tensor self, *, str approximate='none') -> Tensor";
constexpr const char* kGeluBackward = "gelu_backward(Tensor grad_output, Tensor self, *, str approximate='none') -> Tensor";
}  // namespace

TORCH_LIBRARY(fxfuse, m) {
  // Per-channel batch statistics of a 4-D tensor: mean, biased var (which the BN applies)
  // and unbiased var (for the running statistics). On CPU, eager batch_norm's bits.
  m.def(kBnStats);
  // act(batch_norm_apply(input)) with the given statistics.
  m.def(kBnAct);
  m.def(kBnActBackward);
  // In-place forms for composites that own the tensor: bn_act_ overwrites self with
  // bn_act(self, ...); bn_act_backward_ overwrites input with grad_input and returns
  // the parameter gradients (output_mask: weight, bias); bn_act_backward_into_grad_
  // overwrites grad_out with grad_input instead. Same numerics as above.
  m.def(kBnActInplace);
  m.def(kBnActBackwardInplace);
  m.def(kBnActBackwardIntoGrad);
  // The running-statistics update eager's batch_norm makes on the device (CPU's rounding on
  // CPU, CUDA's on CUDA), from the batch's mean and unbiased var: what the fused ops'
  // callers apply after the op (ops/batch_norm_act.py).
  m.def(kUpdateRunningStats);
  // BatchNorm2d(+activation) that keeps only its input for backward. mean / var: the
  // statistics applied (bn_stats' when batch_stats, else the running ones); unbiased_var:
  // the batch's, for the caller's running-statistics update (the running var otherwise).
  m.def(
      "batch_norm_act(Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, "
      "Tensor? running_var, bool batch_stats, float eps, str act, float act_param) "
      "-> (Tensor out, Tensor mean, Tensor var, Tensor unbiased_var)");
  // Conv2d -> BatchNorm2d (-> activation) that keeps only the conv input.
  m.def(
      "conv_bn_act(Tensor input, Tensor weight, Tensor? bias, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups, Tensor? bn_weight, Tensor? bn_bias, "
      "Tensor? running_mean, Tensor? running_var, bool batch_stats, float eps, str act, "
      "float act_param) -> (Tensor out, Tensor mean, Tensor var, Tensor unbiased_var)");
  m.def(
      "conv_bn_act_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "int[2] stride, int[2] padding, int[2] dilation, int groups, Tensor? bn_weight, "
      "Tensor? bn_bias, Tensor mean, Tensor var, bool batch_stats, float eps, str act, "
      "float act_param, bool[5] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias, "
      "Tensor grad_bn_weight, Tensor grad_bn_bias)");
  // BatchNorm2d -> activation -> Conv2d (-> BatchNorm2d -> activation with `epilogue`) that
  // keeps only the first BN's input: backward rebuilds the conv input (and, with the
  // epilogue, the conv output). in_*: the first BN's statistics; mean/var/unbiased_var: the
  // second's (empty without the epilogue).
  m.def(
      "bn_act_conv(Tensor input, Tensor? in_weight, Tensor? in_bias, Tensor? in_running_mean, "
      "Tensor? in_running_var, bool in_batch_stats, float in_eps, str in_act, float in_act_param, "
      "Tensor weight, Tensor? bias, int[2] stride, int[2] padding, int[2] dilation, int groups, "
      "bool epilogue, Tensor? bn_weight, Tensor? bn_bias, Tensor? running_mean, "
      "Tensor? running_var, bool batch_stats, float eps, str act, float act_param) "
      "-> (Tensor out, Tensor in_mean, Tensor in_var, Tensor in_unbiased_var, Tensor mean, "
      "Tensor var, Tensor unbiased_var)");
  m.def(
      "bn_act_conv_backward(Tensor grad_out, Tensor input, Tensor? in_weight, Tensor? in_bias, "
      "Tensor in_mean, Tensor in_var, bool in_batch_stats, float in_eps, str in_act, "
      "float in_act_param, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, bool epilogue, Tensor? bn_weight, Tensor? bn_bias, "
      "Tensor mean, Tensor var, bool batch_stats, float eps, str act, float act_param, "
      "bool[7] output_mask) -> (Tensor grad_input, Tensor grad_in_weight, Tensor grad_in_bias, "
      "Tensor grad_weight, Tensor grad_bias, Tensor grad_bn_weight, Tensor grad_bn_bias)");
  // F.gelu and aten::gelu_backward (approximate: "none" or "tanh").
  m.def(kGelu);
  m.def(kGeluBackward);
  // act(F.linear(input, weight, bias)) that keeps only input, weight and bias for backward.
  m.def(
      "linear_act(Tensor input, Tensor weight, Tensor? bias, str act, float act_param) "
      "-> Tensor");
  m.def(
      "linear_act_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "str act, float act_param, bool[3] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // F.linear(act(input), weight, bias) that keeps only input, weight and bias for backward.
  m.def(
      "act_linear(Tensor input, Tensor weight, Tensor? bias, str act, float act_param) "
      "-> Tensor");
  m.def(
      "act_linear_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "str act, float act_param, bool[3] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // F.linear(act(input), weight, bias) * scale (one scale per output feature) that keeps only
  // input and the parameters for backward (generic/act_linear_scale.cpp).
  m.def(
      "act_linear_scale(Tensor input, Tensor weight, Tensor? bias, Tensor scale, str act, "
      "float act_param) -> Tensor");
  m.def(
      "act_linear_scale_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "Tensor scale, str act, float act_param, bool[4] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias, Tensor grad_scale)");
  // F.linear(F.layer_norm(input, normalized_shape, ln_weight, ln_bias, eps), weight, bias)
  // that keeps only input and the parameters for backward (generic/layer_norm_linear.cpp).
  m.def(
      "layer_norm_linear(Tensor input, int[] normalized_shape, Tensor? ln_weight, "
      "Tensor? ln_bias, float eps, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "layer_norm_linear_backward(Tensor grad_out, Tensor input, int[] normalized_shape, "
      "Tensor? ln_weight, Tensor? ln_bias, float eps, Tensor weight, Tensor? bias, "
      "bool[5] output_mask) -> (Tensor grad_input, Tensor grad_ln_weight, Tensor grad_ln_bias, "
      "Tensor grad_weight, Tensor grad_bias)");
  // F.linear(F.layer_norm(F.conv2d(input, ...).permute(0, 2, 3, 1), ...), weight, bias) that
  // keeps only the conv's input and the parameters (the conv runs again in backward).
  m.def(
      "conv_layer_norm_linear(Tensor input, Tensor conv_weight, Tensor? conv_bias, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups, int[] normalized_shape, Tensor? ln_weight, "
      "Tensor? ln_bias, float eps, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "conv_layer_norm_linear_backward(Tensor grad_out, Tensor input, Tensor conv_weight, "
      "Tensor? conv_bias, int[2] stride, int[2] padding, int[2] dilation, int groups, "
      "int[] normalized_shape, Tensor? ln_weight, Tensor? ln_bias, float eps, Tensor weight, "
      "Tensor? bias, bool[7] output_mask) -> (Tensor grad_input, Tensor grad_conv_weight, "
      "Tensor grad_conv_bias, Tensor grad_ln_weight, Tensor grad_ln_bias, Tensor grad_weight, "
      "Tensor grad_bias)");
  // act(F.conv2d(input, weight, bias, ...)) that keeps only input, weight and bias.
  m.def(
      "conv_act(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, str act, float act_param) -> Tensor");
  m.def(
      "conv_act_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "int[2] stride, int[2] padding, int[2] dilation, int groups, str act, float act_param, "
      "bool[3] output_mask) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // F.avg_pool2d, whose backward needs only its input's shape, dtype and strides: its autograd
  // (ops/avg_pool2d.py) keeps none of the input, where eager's keeps all of it.
  m.def(
      "avg_pool2d(Tensor input, int[2] kernel_size, int[2] stride, int[2] padding, "
      "bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor");
  // F.max_pool2d, returning besides its output where each maximum lies in its window (one byte
  // per output element): its autograd (ops/max_pool2d.py) keeps only those, where eager's keeps
  // the input and int64 indices.
  m.def(
      "max_pool2d(Tensor input, int[2] kernel_size, int[2] stride, int[2] padding, "
      "int[2] dilation, bool ceil_mode) -> (Tensor output, Tensor window_offsets)");
  // ATen's flat indices (row * input_width + column) of max_pool2d's maxima, from its window_offsets.
  m.def(
      "max_pool2d_indices(Tensor window_offsets, int input_width, int[2] kernel_size, int[2] stride, "
      "int[2] padding, int[2] dilation) -> Tensor");
  // F.conv2d(input, weight, bias, stride, padding, dilation, groups), whose backward is
  // conv2d_backward: the gradients as aten::convolution_backward gives them, the backward of
  // every fxfuse op holding a conv. On CPU a large-kernel depthwise conv's weight and bias
  // gradients come from fxfuse's own kernel.
  m.def(
      "conv2d(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups) -> Tensor");
  m.def(
      "conv2d_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor? bias, "
      "int[2] stride, int[2] padding, int[2] dilation, int groups, bool[3] output_mask) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}

// The device-generic kernels, and the host build of the CUDA kernels' per-element math
// (cpu/bn_act_elementwise.cpp), under namespaces of their own with the same schemas, so
// that the tests can run them on CPU, where torch.ops.fxfuse dispatches to the
// hand-written kernels.
TORCH_LIBRARY(fxfuse_generic, m) {
  for (const char* schema : {kBnStats, kBnAct, kBnActBackward, kBnActInplace, kBnActBackwardInplace,
                             kBnActBackwardIntoGrad, kGelu, kGeluBackward}) {
    m.def(schema);
  }
  // The switch of generic_path.h: routes CPU tensors of torch.ops.fxfuse to these kernels.
  m.def("set_enabled(bool enabled) -> bool", [](bool enabled) { return fxfuse::set_generic_path(enabled); });
  m.def("enabled() -> bool", [] { return fxfuse::generic_path(); });
}

TORCH_LIBRARY_IMPL(fxfuse_generic, CompositeExplicitAutograd, m) {
  m.impl("bn_stats", &fxfuse::bn_stats_generic);
  m.impl("bn_act", &fxfuse::bn_act_generic);
  m.impl("bn_act_backward", &fxfuse::bn_act_backward_generic);
  m.impl("bn_act_", &fxfuse::bn_act_generic_);
  m.impl("bn_act_backward_", &fxfuse::bn_act_backward_generic_);
  m.impl("bn_act_backward_into_grad_", &fxfuse::bn_act_backward_into_grad_generic_);
  m.impl("gelu", &fxfuse::gelu_generic);
  m.impl("gelu_backward", &fxfuse::gelu_backward_generic);
}

TORCH_LIBRARY(fxfuse_elementwise, m) {
  m.def(kBnAct, &fxfuse::bn_act_elementwise_host);
  m.def(kBnActBackward, &fxfuse::bn_act_backward_elementwise_host);
  m.def(kBnActInplace, &fxfuse::bn_act_elementwise_host_);
  m.def(kBnActBackwardInplace, &fxfuse::bn_act_backward_elementwise_host_);
  m.def(kBnActBackwardIntoGrad, &fxfuse::bn_act_backward_into_grad_elementwise_host_);
  m.def(kBnStats, &fxfuse::bn_stats_elementwise_host);
  m.def(kUpdateRunningStats, &fxfuse::update_running_stats_elementwise_host_);
  m.def(
      "bn_stats_update(Tensor input, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
      "float momentum, float eps) -> (Tensor mean, Tensor invstd, Tensor var, Tensor unbiased_var)",
      &fxfuse::bn_stats_update_elementwise_host);
  m.def(
      "bn_act_invstd(Tensor input, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, "
      "str act, float act_param) -> Tensor",
      &fxfuse::bn_act_invstd_elementwise_host);
  m.def(
      "bn_act_backward_invstd(Tensor grad_out, Tensor input, Tensor mean, Tensor invstd, "
      "Tensor? weight, Tensor? bias, str act, float act_param, bool batch_stats, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
      &fxfuse::bn_act_backward_invstd_elementwise_host);
}

// `import fxfuse._C` runs the registrations above. The module holds what the tests ask (the CPU
// kernels' build selection, cpu/capability.h, and the activation names) and the ops' direct
// calls (direct_calls.cpp).
namespace {
PyObject* py_cpu_id(PyObject*, PyObject*) {
  const fxfuse::cpu::CpuId id = fxfuse::cpu::read_cpu_id();
  return Py_BuildValue("(IIK)", id.leaf1_ecx, id.leaf7_ebx, static_cast<unsigned long long>(id.xcr0));
}

PyObject* py_avx2_fma_usable(PyObject*, PyObject* args) {
  unsigned int leaf1_ecx = 0, leaf7_ebx = 0;
  unsigned long long xcr0 = 0;
  if (!PyArg_ParseTuple(args, "IIK", &leaf1_ecx, &leaf7_ebx, &xcr0)) return nullptr;
  return PyBool_FromLong(fxfuse::cpu::avx2_fma_usable({leaf1_ecx, leaf7_ebx, xcr0}));
}

PyObject* py_cpu_kernel_build(PyObject*, PyObject*) {
  return PyUnicode_FromString(fxfuse::cpu::kernel_build().c_str());
}

PyObject* py_activations(PyObject*, PyObject*) {
  PyObject* names = PyTuple_New(fxfuse::kNumActs);
  if (names == nullptr) return nullptr;
  for (int i = 0; i < fxfuse::kNumActs; ++i) {
    PyObject* name = PyUnicode_FromString(fxfuse::kActNames[i]);
    if (name == nullptr) {
      Py_DECREF(names);
      return nullptr;
    }
    PyTuple_SET_ITEM(names, i, name);
  }
  return names;
}

PyMethodDef methods[] = {
    {"_cpu_id", py_cpu_id, METH_NOARGS, "(CPUID.1:ECX, CPUID.7.0:EBX, XCR0) of this CPU"},
    {"_avx2_fma_usable", py_avx2_fma_usable, METH_VARARGS,
     "Whether the AVX2 kernels can run given (CPUID.1:ECX, CPUID.7.0:EBX, XCR0)"},
    {"_cpu_kernel_build", py_cpu_kernel_build, METH_NOARGS, "The CPU kernel build in use: 'AVX2' or 'DEFAULT'"},
    {"_activations", py_activations, METH_NOARGS, "The activation names of the op schemas, in Act order (act.h)"},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "fxfuse C++ operators", -1, methods};
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && PyModule_AddFunctions(m, fxfuse::direct_call_methods()) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
