// What fxfuse._C holds besides its ops: the namespace's one TORCH_LIBRARY, the generic-path
// switch, the tests' namespaces and the Python module. Each op is a set of files named by the op
// (or the family of ops it belongs to), as torchvision lays out csrc/ops:
//   generic/<op>.cpp  its schema (TORCH_LIBRARY_FRAGMENT) and its device-generic implementation
//                     from ATen calls (CompositeExplicitAutograd: CUDA and every other device),
//   cpu/*.cpp         hand-written CPU kernels,
//   cuda/*.cu         CUDA kernels (built with FXFUSE_CUDA=1),
//   autocast/*.cpp    Autocast kernels: the casts eager autocast applies, then the op,
//   autograd/*.cpp    every op's Autograd kernel: torch::autograd::Function, no Python per call.
// Every fake (meta) kernel, and the cat_ forms' schemas and kernels (over their base ops'), are
// registered from Python (fxfuse/ops/).
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

// The schemas that the tests' namespaces below share with torch.ops.fxfuse, defined beside their
// ops' kernels (bn_act.h, activation_ops.h).
using namespace fxfuse::schemas;

// The namespace's one TORCH_LIBRARY: each op defines its schema in a TORCH_LIBRARY_FRAGMENT of its
// generic/<op>.cpp. A second TORCH_LIBRARY(fxfuse, ...), in this library or another, fails at load.
TORCH_LIBRARY(fxfuse, m) {}

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
