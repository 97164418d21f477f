// Direct calls from Python into fxfuse's ops: fxfuse._C.<op>(*args) calls the op through the
// dispatcher's typed handle, as torch's own bindings call ATen ops. torch.ops.fxfuse.<op> takes
// the JIT's boxed path instead (argument matching against the schema, a boxed stack, unboxing
// into the kernel), a few microseconds a call, which a GPU step waits on for each fused site.
// Every dispatch key still applies (Autograd, Autocast, functorch, Python modes, Meta), so the
// op computes what torch.ops.fxfuse.<op> computes. Arguments that are not plainly what the
// schema takes (a Tensor subclass, a bool where an int goes, keywords, ...) or an active
// __torch_function__ mode: the call goes to torch.ops.fxfuse.<op>.default, which handles every
// case. Under dynamo, fxfuse/ops/direct.py substitutes torch.ops for these functions.
#include <Python.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "direct_calls.h"

namespace fxfuse {
namespace {

struct NotDirect {};  // an argument the direct path does not take: torch.ops takes the call

template <class T>
struct Arg;

template <>
struct Arg<at::Tensor> {
  at::Tensor value;
  explicit Arg(PyObject* obj) {
    if (!THPVariable_CheckExact(obj)) throw NotDirect{};
    value = THPVariable_Unpack(obj);
  }
  at::Tensor& get() { return value; }  // Tensor(a!) arguments bind to it too
};

template <>
struct Arg<std::optional<at::Tensor>> {
  std::optional<at::Tensor> value;
  explicit Arg(PyObject* obj) {
    if (obj == Py_None) return;
    if (!THPVariable_CheckExact(obj)) throw NotDirect{};
    value = THPVariable_Unpack(obj);
  }
  const std::optional<at::Tensor>& get() const { return value; }
};

template <>
struct Arg<bool> {
  bool value;
  explicit Arg(PyObject* obj) {
    if (obj != Py_True && obj != Py_False) throw NotDirect{};
    value = obj == Py_True;
  }
  bool get() const { return value; }
};

template <>
struct Arg<double> {
  double value;
  explicit Arg(PyObject* obj) {
    if (!PyFloat_CheckExact(obj)) throw NotDirect{};
    value = PyFloat_AS_DOUBLE(obj);
  }
  double get() const { return value; }
};

inline int64_t exact_int(PyObject* obj) {
  if (!PyLong_CheckExact(obj)) throw NotDirect{};
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow != 0) throw NotDirect{};
  return v;
}

template <>
struct Arg<int64_t> {
  int64_t value;
  explicit Arg(PyObject* obj) : value(exact_int(obj)) {}
  int64_t get() const { return value; }
};

template <>
struct Arg<c10::string_view> {
  c10::string_view value;
  explicit Arg(PyObject* obj) {
    if (!PyUnicode_CheckExact(obj)) throw NotDirect{};
    Py_ssize_t size = 0;
    const char* data = PyUnicode_AsUTF8AndSize(obj, &size);
    if (data == nullptr) throw python_error();
    value = c10::string_view(data, static_cast<size_t>(size));
  }
  c10::string_view get() const { return value; }
};

// int[N]: a list or tuple of ints (torch.ops also broadcasts a single int: that takes torch.ops).
template <>
struct Arg<c10::ArrayRef<int64_t>> {
  std::vector<int64_t> value;
  explicit Arg(PyObject* obj) {
    if (!PyList_CheckExact(obj) && !PyTuple_CheckExact(obj)) throw NotDirect{};
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    value.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) value.push_back(exact_int(items[i]));
  }
  c10::ArrayRef<int64_t> get() const { return value; }
};

inline PyObject* wrap(at::Tensor t) { return THPVariable_Wrap(std::move(t)); }

template <class... Ts, size_t... I>
PyObject* wrap_tuple(std::tuple<Ts...>&& values, std::index_sequence<I...>) {
  PyObject* result = PyTuple_New(sizeof...(Ts));
  if (result == nullptr) throw python_error();
  (PyTuple_SET_ITEM(result, I, wrap(std::move(std::get<I>(values)))), ...);
  return result;
}

template <class... Ts>
PyObject* wrap(std::tuple<Ts...>&& values) {
  return wrap_tuple(std::move(values), std::index_sequence_for<Ts...>{});
}

// torch.ops.fxfuse.<op>.default for "fxfuse::<op>" (a new reference, kept for the process), or
// nullptr with the Python error set.
PyObject* torch_ops_overload(const char* qualified) {
  const char* name = std::strchr(qualified, ':') + 2;
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) return nullptr;
  PyObject* result = torch;
  for (const char* attr : {"ops", "fxfuse", name, "default"}) {
    PyObject* next = PyObject_GetAttrString(result, attr);
    Py_DECREF(result);
    if (next == nullptr) return nullptr;
    result = next;
  }
  return result;
}

// The direct call of the op named `Name`, whose C++ signature (the schema's, as typed<>() checks
// it against the registered schema at the first call) is `Ret(Args...)`.
template <const char* Name, class Sig>
struct Direct;

template <const char* Name, class Ret, class... Args>
struct Direct<Name, Ret(Args...)> {
  template <size_t... I>
  static Ret call(PyObject* const* args, std::index_sequence<I...>) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow(Name, "").template typed<Ret(Args...)>();
    // Converted in order: std::tuple's braced initialization evaluates left to right.
    std::tuple<Arg<std::decay_t<Args>>...> converted{Arg<std::decay_t<Args>>(args[I])...};
    // As torch's bindings do: other Python threads run while the op does.
    PyThreadState* state = PyEval_SaveThread();
    struct Restore {
      PyThreadState* state;
      ~Restore() { PyEval_RestoreThread(state); }
    } restore{state};
    return op.call(std::get<I>(converted).get()...);
  }

  static PyObject* entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs == static_cast<Py_ssize_t>(sizeof...(Args)) && !at::impl::torch_function_mode_enabled()) {
      try {
        if constexpr (std::is_void_v<Ret>) {
          call(args, std::index_sequence_for<Args...>{});
          Py_RETURN_NONE;
        } else {
          return wrap(call(args, std::index_sequence_for<Args...>{}));
        }
      } catch (const NotDirect&) {
      }
    }
    static PyObject* overload = torch_ops_overload(Name);
    if (overload == nullptr) return nullptr;
    return PyObject_Vectorcall(overload, args, static_cast<size_t>(nargs), nullptr);
    END_HANDLE_TH_ERRORS
  }
};

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;
using Ints = c10::ArrayRef<int64_t>;
using Str = c10::string_view;
using Stats = std::tuple<Tensor, Tensor, Tensor, Tensor>;

constexpr char kBatchNormAct[] = "fxfuse::batch_norm_act";
constexpr char kConvBnAct[] = "fxfuse::conv_bn_act";
constexpr char kBnActConv[] = "fxfuse::bn_act_conv";
constexpr char kUpdateRunningStats[] = "fxfuse::update_running_stats_";
constexpr char kConvAct[] = "fxfuse::conv_act";
constexpr char kLinearAct[] = "fxfuse::linear_act";
constexpr char kActLinear[] = "fxfuse::act_linear";
constexpr char kActLinearScale[] = "fxfuse::act_linear_scale";
constexpr char kLayerNormLinear[] = "fxfuse::layer_norm_linear";
constexpr char kConvLayerNormLinear[] = "fxfuse::conv_layer_norm_linear";

using BatchNormAct = Direct<
    kBatchNormAct,
    Stats(const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, bool,
          double, Str, double)>;
using ConvBnAct = Direct<
    kConvBnAct,
    Stats(const Tensor&, const Tensor&, const OptTensor&, Ints, Ints, Ints, int64_t, const OptTensor&,
          const OptTensor&, const OptTensor&, const OptTensor&, bool, double, Str, double)>;
using BnActConv = Direct<
    kBnActConv,
    std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
        const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, bool,
        double, Str, double, const Tensor&, const OptTensor&, Ints, Ints, Ints, int64_t, bool,
        const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, bool, double, Str,
        double)>;
using UpdateRunningStats = Direct<
    kUpdateRunningStats, void(Tensor&, Tensor&, const Tensor&, const Tensor&, double)>;
using ConvAct = Direct<
    kConvAct,
    Tensor(const Tensor&, const Tensor&, const OptTensor&, Ints, Ints, Ints, int64_t, Str, double)>;
using LinearAct =
    Direct<kLinearAct, Tensor(const Tensor&, const Tensor&, const OptTensor&, Str, double)>;
using ActLinear =
    Direct<kActLinear, Tensor(const Tensor&, const Tensor&, const OptTensor&, Str, double)>;
using ActLinearScale = Direct<
    kActLinearScale,
    Tensor(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, Str, double)>;
using LayerNormLinear = Direct<
    kLayerNormLinear,
    Tensor(const Tensor&, Ints, const OptTensor&, const OptTensor&, double, const Tensor&,
           const OptTensor&)>;
using ConvLayerNormLinear = Direct<
    kConvLayerNormLinear,
    Tensor(const Tensor&, const Tensor&, const OptTensor&, Ints, Ints, Ints, int64_t, Ints,
           const OptTensor&, const OptTensor&, double, const Tensor&, const OptTensor&)>;

template <class D>
constexpr PyCFunction fast() {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&D::entry));
}

PyMethodDef methods[] = {
    {"batch_norm_act", fast<BatchNormAct>(), METH_FASTCALL, "fxfuse::batch_norm_act, called directly"},
    {"conv_bn_act", fast<ConvBnAct>(), METH_FASTCALL, "fxfuse::conv_bn_act, called directly"},
    {"bn_act_conv", fast<BnActConv>(), METH_FASTCALL, "fxfuse::bn_act_conv, called directly"},
    {"update_running_stats_", fast<UpdateRunningStats>(), METH_FASTCALL,
     "fxfuse::update_running_stats_, called directly"},
    {"conv_act", fast<ConvAct>(), METH_FASTCALL, "fxfuse::conv_act, called directly"},
    {"linear_act", fast<LinearAct>(), METH_FASTCALL, "fxfuse::linear_act, called directly"},
    {"act_linear", fast<ActLinear>(), METH_FASTCALL, "fxfuse::act_linear, called directly"},
    {"act_linear_scale", fast<ActLinearScale>(), METH_FASTCALL,
     "fxfuse::act_linear_scale, called directly"},
    {"layer_norm_linear", fast<LayerNormLinear>(), METH_FASTCALL,
     "fxfuse::layer_norm_linear, called directly"},
    {"conv_layer_norm_linear", fast<ConvLayerNormLinear>(), METH_FASTCALL,
     "fxfuse::conv_layer_norm_linear, called directly"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMethodDef* direct_call_methods() { return methods; }

}  // namespace fxfuse
