// Hand-written CPU kernels for bn_stats, bn_act and bn_act_backward.
//
// This file holds the operator entry points (validation, layout and dtype
// routing, per-channel coefficients, the CPU dispatch-key registration) and the
// DEFAULT-capability build of the kernel bodies; bn_act_kernel_avx2.cpp holds
// the AVX2 build of the same bodies. See bn_act_kernel.h and
// bn_act_kernel_impl.h for the design.
//
// Routing:
//  * float / double, contiguous NCHW or channels_last: hand-written kernels
//    (bn_stats: NCHW with H*W > 1 only; every other input gets ATen's own statistics);
//  * any other dtype (half, bfloat16, ...) or layout: the device-generic ATen
//    implementation (bn_act_generic & co.);
//  * empty inputs: the generic implementation too (it returns correctly shaped
//    empty / NaN / zero results without touching data).
//
// Numerics: the training forward is eager batch_norm's bit for bit under every CPU
// capability (statistics, invstd, z = x * alpha + beta), so that activation branches
// (relu's z > 0) fall exactly as in eager. The backward recomputes that z and follows
// bn_act_backward_generic's formulas, with its reductions in double.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Dispatch.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../activation_ops.h"
#include "../bn_act.h"
#include "../bn_act_host_setup.h"
#include "../checks.h"
#include "../generic_path.h"
#include "bn_act_kernel.h"
#include "bn_act_kernel_impl.h"
#include "gelu_kernel.h"

namespace fxfuse {
namespace {

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }


template <typename T>
const cpu::KernelTable<T>& kernel_table() {
#if FXFUSE_HAVE_AVX2_KERNELS
  if (cpu::use_avx2_kernels()) return cpu::AVX2::kernels<T>();
#endif
  return cpu::DEFAULT::kernels<T>();
}

bool fast_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kDouble; }

// The layout the hand-written kernels see `t` in, and the memory format another
// tensor must have to share it; nullopt for layouts they do not handle.
std::optional<std::pair<cpu::Geometry, at::MemoryFormat>> geometry(const at::Tensor& t) {
  const int64_t N = t.size(0), C = t.size(1), HW = t.size(2) * t.size(3);
  if (t.is_contiguous()) {
    // With H*W == 1, NCHW is also N rows of C channels: use the row kernels.
    return std::make_pair(cpu::Geometry{N, C, HW, HW == 1}, at::MemoryFormat::Contiguous);
  }
  if (t.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return std::make_pair(cpu::Geometry{N, C, HW, true}, at::MemoryFormat::ChannelsLast);
  }
  return std::nullopt;
}

// Per-channel coefficients in dtype T, computed as ATen's batch_norm computes them from
// batch statistics: invstd = 1 / sqrt(var + eps) in double (its InvStd<double>),
// alpha = invstd * weight (or invstd), beta = bias - mean * alpha (kernels' shift).
// Running statistics get the same invstd; eager's evaluation-mode batch_norm computes that
// one in T, so eval outputs can differ from eager's in the last bit. k1/k2 are filled in
// by the backward.
template <typename T>
struct ChannelParams {
  at::Tensor mean;  // contiguous, dtype T
  std::vector<T> invstd, alpha, beta, k1, k2;

  cpu::Coeffs<T> coeffs() const {
    return {mean.const_data_ptr<T>(), alpha.data(), beta.data(), invstd.data(),
            k1.empty() ? nullptr : k1.data(), k2.empty() ? nullptr : k2.data()};
  }
};

template <typename T>
ChannelParams<T> channel_params(
    const at::Tensor& mean, const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps) {
  const auto dt = c10::CppTypeToScalarType<T>::value;
  const int64_t C = mean.numel();
  ChannelParams<T> cp;
  cp.mean = elementwise::in_dtype(mean, dt);
  const at::Tensor v = elementwise::in_dtype(var, dt);
  const at::Tensor w = elementwise::in_dtype(weight, dt), b = elementwise::in_dtype(bias, dt);
  const T* vp = v.const_data_ptr<T>();
  const T* wp = w.defined() ? w.const_data_ptr<T>() : nullptr;
  cp.invstd.resize(C);
  cp.alpha.resize(C);
  cp.beta.resize(C);
  for (int64_t c = 0; c < C; ++c) {
    const double vc = static_cast<double>(vp[c]);
    const T invstd = (vc != 0 || eps != 0) ? static_cast<T>(1.0 / std::sqrt(vc + eps)) : T(0);
    cp.invstd[c] = invstd;
    cp.alpha[c] = wp ? invstd * wp[c] : invstd;
  }
  kernel_table<T>().shift(
      C, cp.mean.template const_data_ptr<T>(), cp.alpha.data(),
      b.defined() ? b.const_data_ptr<T>() : nullptr, cp.beta.data());
  return cp;
}

// Float32, contiguous NCHW with H*W > 1: ATen's own reduction for that case
// (batch_norm_cpu_collect_stats_contiguous_impl), so that the statistics are eager's bit
// for bit, at about half its time. Per channel: a sequential sum in double of x,
// mean = (float)(sum / M), then a sequential sum in double of the float squares
// (x - mean)^2. Each sum is one chain of dependent adds, which ATen runs one channel at a
// time; here kLanes channels run side by side to hide the adds' latency, each still summed
// in ATen's order, so the result depends neither on the ISA nor on the thread count.
// (Float64 gets ATen's reduction itself: its builds fuse some of the double
// multiply-adds, depending on how the compiler split the loop.)
constexpr int kLanes = 8;

template <int L>
void stats_lanes(const cpu::Geometry& g, const float* x, int64_t c0, float* mean, float* var_sum) {
  const int64_t N = g.N, C = g.C, HW = g.HW, M = N * HW;
  double s[L] = {};
  for (int64_t n = 0; n < N; ++n) {
    const float* p = x + (n * C + c0) * HW;
    for (int64_t i = 0; i < HW; ++i) {
      for (int k = 0; k < L; ++k) s[k] += static_cast<double>(p[k * HW + i]);
    }
  }
  float m[L];
  for (int k = 0; k < L; ++k) m[k] = static_cast<float>(s[k] / M);
  double q[L] = {};
  for (int64_t n = 0; n < N; ++n) {
    const float* p = x + (n * C + c0) * HW;
    for (int64_t i = 0; i < HW; ++i) {
      for (int k = 0; k < L; ++k) {
        const float d = p[k * HW + i] - m[k];
        q[k] += static_cast<double>(d * d);
      }
    }
  }
  for (int k = 0; k < L; ++k) {
    mean[c0 + k] = m[k];
    var_sum[c0 + k] = static_cast<float>(q[k]);
  }
}

void stats_nchw_float(const cpu::Geometry& g, const float* x, float* mean, float* var_sum) {
  const int64_t grain = std::max<int64_t>(1, 32768 / (kLanes * g.N * g.HW));
  at::parallel_for(0, (g.C + kLanes - 1) / kLanes, grain, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t c0 = blk * kLanes;
      if (c0 + kLanes <= g.C) {
        stats_lanes<kLanes>(g, x, c0, mean, var_sum);
      } else {
        for (int64_t c = c0; c < g.C; ++c) stats_lanes<1>(g, x, c, mean, var_sum);
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_cpu(const at::Tensor& input) {
  checks::bn_input(input, "bn_stats");
  if (input.numel() == 0 || generic_path()) return bn_stats_generic(input);
  const auto geo = geometry(input);
  if (input.scalar_type() != at::kFloat || !geo || geo->first.nhwc) return bn_stats_generic(input);  // ATen's own reduction
  const int64_t C = input.size(1), M = input.numel() / C;
  at::Tensor mean = at::empty({C}, input.options());
  at::Tensor var = at::empty({C}, input.options());
  at::Tensor unbiased = at::empty({C}, input.options());
  std::vector<float> var_sum(C);
  stats_nchw_float(geo->first, input.const_data_ptr<float>(), mean.mutable_data_ptr<float>(), var_sum.data());
  float* vp = var.mutable_data_ptr<float>();
  float* up = unbiased.mutable_data_ptr<float>();
  for (int64_t c = 0; c < C; ++c) {
    // float / int64 -> float, as ATen divides (batch_norm_cpu_update_stats_template)
    vp[c] = var_sum[c] / M;
    up[c] = var_sum[c] / (M - 1);
  }
  return {mean, var, unbiased};
}

namespace {

// act(batch_norm_apply(input)) into `out`, which has the input's layout (a fresh
// tensor, or the input itself: each element is read before it is written).
void forward_into(
    const at::Tensor& input, const cpu::Geometry& g, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, Act a, double act_param,
    const at::Tensor& out) {
  if (input.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "fxfuse::bn_act_cpu", [&] {
    const auto cp = channel_params<scalar_t>(mean, var, weight, bias, eps);
    kernel_table<scalar_t>().forward(
        g, input.const_data_ptr<scalar_t>(), cp.coeffs(), a, static_cast<scalar_t>(act_param),
        out.mutable_data_ptr<scalar_t>());
  });
  // Eager's GELU of a contiguous float32 batch_norm output is oneDNN's.
  if (a == Act::GELU && out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() > 1 &&
      cpu::onednn_runs_gelu()) {
    cpu::gelu_overflow_as_onednn(out);
  }
}

// Activations whose derivative costs more to recompute than writing and reading it back.
bool costly_derivative(Act a) {
  return a == Act::GELU || a == Act::GELUTanh || a == Act::SiLU;
}

// Whether the hand-written backward kernels take this call (else: the generic path).
bool backward_fast(const at::Tensor& grad_out, const at::Tensor& input) {
  return !generic_path() && fast_dtype(input.scalar_type()) && geometry(input) && input.numel() != 0 &&
      grad_out.defined() && grad_out.device().is_cpu() && grad_out.sizes() == input.sizes();
}

// (grad_weight, grad_bias) of bn_act_backward; grad_input is written to `grad_input`
// when it is defined (a fresh tensor in the input's layout, or the input itself:
// the last pass reads each element of the input before writing it).
std::tuple<at::Tensor, at::Tensor> backward_into(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, Act a, double act_param,
    bool batch_stats, bool need_weight, bool need_bias, const at::Tensor& grad_input) {
  const auto geo = geometry(input);
  const cpu::Geometry& g = geo->first;
  // grad_out in the input's dtype and memory layout (no copy in the usual case).
  const at::Tensor dy = grad_out.scalar_type() == input.scalar_type()
      ? grad_out.contiguous(geo->second)
      : grad_out.to(input.scalar_type()).contiguous(geo->second);

  const bool need_input = grad_input.defined();
  const bool has_weight = has(weight), has_bias = has(bias);
  const bool need_sums = need_weight || need_bias || (need_input && batch_stats);
  const int64_t C = input.size(1);
  const int64_t M = input.numel() / C;

  at::Tensor grad_weight, grad_bias;
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "fxfuse::bn_act_backward_cpu", [&] {
    using T = scalar_t;
    const auto& kt = kernel_table<T>();
    auto cp = channel_params<T>(mean, var, weight, bias, eps);
    const T* xp = input.const_data_ptr<T>();
    const T* dyp = dy.const_data_ptr<T>();
    const T param = static_cast<T>(act_param);

    // With an activation whose derivative costs more than a memory pass (erf, exp), the
    // reduction writes g = dy * act'(z) into grad_input's buffer and the grad_input pass
    // reads it back (as act "none"), instead of computing act' a second time. Same bits:
    // both passes compute g the same way. Not when grad_input is the input, still to be read.
    T* g_stored = nullptr;
    if (need_sums && need_input && costly_derivative(a) &&
        grad_input.data_ptr() != input.data_ptr()) {
      g_stored = grad_input.mutable_data_ptr<T>();
    }
    // sum_g and sum_gx = sum(g * xhat), rounded to T as the generic path has them.
    std::vector<T> sum_g(C, T(0)), sum_gx(C, T(0));
    if (need_sums) {
      std::vector<double> sg(C), sgxm(C);
      kt.backward_reduce(g, dyp, xp, cp.coeffs(), a, param, sg.data(), sgxm.data(), g_stored);
      for (int64_t c = 0; c < C; ++c) {
        sum_g[c] = static_cast<T>(sg[c]);
        sum_gx[c] = static_cast<T>(sgxm[c] * static_cast<double>(cp.invstd[c]));
      }
    }
    if (need_input) {
      if (batch_stats) {
        const T m = static_cast<T>(static_cast<double>(M));
        cp.k1.resize(C);
        cp.k2.resize(C);
        for (int64_t c = 0; c < C; ++c) {
          cp.k1[c] = sum_g[c] / m;
          cp.k2[c] = sum_gx[c] / m;
        }
      }
      kt.backward_input(
          g, g_stored ? g_stored : dyp, xp, cp.coeffs(), batch_stats, g_stored ? Act::None : a,
          param, grad_input.mutable_data_ptr<T>());
    }
    auto to_tensor = [&](const std::vector<T>& v, at::ScalarType dtype) {
      at::Tensor t = at::empty({C}, input.options());
      std::copy(v.begin(), v.end(), t.mutable_data_ptr<T>());
      return dtype == t.scalar_type() ? t : t.to(dtype);
    };
    if (need_weight && has_weight) grad_weight = to_tensor(sum_gx, weight->scalar_type());
    if (need_bias && has_bias) grad_bias = to_tensor(sum_g, bias->scalar_type());
  });
  return {grad_weight, grad_bias};
}

}  // namespace

at::Tensor bn_act_cpu(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act");
  const Act a = parse_act(act);
  const auto geo = geometry(input);
  if (!fast_dtype(input.scalar_type()) || !geo || generic_path()) {
    return bn_act_generic(input, mean, var, weight, bias, eps, act, act_param);
  }
  at::Tensor out = at::empty_like(input);
  forward_into(input, geo->first, mean, var, weight, bias, eps, a, act_param, out);
  return out;
}

void bn_act_cpu_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  checks::bn_args(self, mean, var, weight, bias, "bn_act_");
  const Act a = parse_act(act);
  const auto geo = geometry(self);
  if (!fast_dtype(self.scalar_type()) || !geo || generic_path()) {
    bn_act_generic_(self, mean, var, weight, bias, eps, act, act_param);
    return;
  }
  forward_into(self, geo->first, mean, var, weight, bias, eps, a, act_param, self);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward");
  const Act a = parse_act(act);
  if (!backward_fast(grad_out, input)) {
    return bn_act_backward_generic(
        grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
        output_mask);
  }
  at::Tensor grad_input = output_mask[0] ? at::empty_like(input) : at::Tensor();
  auto [grad_weight, grad_bias] = backward_into(
      grad_out, input, mean, var, weight, bias, eps, a, act_param, batch_stats, output_mask[1],
      output_mask[2], grad_input);
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_cpu_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward_");
  const Act a = parse_act(act);
  if (!backward_fast(grad_out, input)) {
    return bn_act_backward_generic_(
        grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
        output_mask);
  }
  return backward_into(
      grad_out, input, mean, var, weight, bias, eps, a, act_param, batch_stats, output_mask[0],
      output_mask[1], input);
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_cpu_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward_into_grad_");
  const Act a = parse_act(act);
  const auto geo = geometry(input);
  // backward_into reads grad_out through a view in the input's dtype and layout; writing
  // grad_input over grad_out is safe when that view is grad_out itself (the reductions
  // finish before the last pass, which reads each element before writing it).
  // Otherwise: bn_act_backward, then a copy. Other dtypes than float / double: the generic
  // form, which writes over grad_out itself where it can.
  if (generic_path() || !fast_dtype(input.scalar_type())) {
    return bn_act_backward_into_grad_generic_(
        grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
        output_mask);
  }
  if (!backward_fast(grad_out, input) || grad_out.scalar_type() != input.scalar_type() ||
      !grad_out.is_contiguous(geo->second)) {
    auto [grad_input, grad_weight, grad_bias] = bn_act_backward_cpu(
        grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
        {true, output_mask[0], output_mask[1]});
    grad_out.copy_(grad_input);
    return {grad_weight, grad_bias};
  }
  at::assert_no_partial_overlap(grad_out, input);
  return backward_into(
      grad_out, input, mean, var, weight, bias, eps, a, act_param, batch_stats, output_mask[0],
      output_mask[1], grad_out);
}

// update_running_stats_generic_'s ATen calls as one loop, for what they would run on one
// dtype: each multiply, subtract and add rounds once in that dtype or in double, as the
// separate elementwise ops do (this file builds without FMA contraction), so the bits are
// theirs. A call from Python, 256 channels: 4 us, against 22 for the ATen calls and 31 for
// them from Python (tests/test_ops_batch_norm_act.py checks the bits against eager's).
namespace {
void update_running_stats_cpu_(
    at::Tensor& running_mean, at::Tensor& running_var, const at::Tensor& mean,
    const at::Tensor& unbiased_var, double momentum) {
  const auto dtype = running_mean.scalar_type();
  const int64_t C = running_mean.numel();
  bool plain = fast_dtype(dtype);
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&running_mean, &running_var, &mean, &unbiased_var}) {
    plain = plain && t->scalar_type() == dtype && t->is_contiguous() && t->dim() == 1 &&
        t->numel() == C;
  }
  if (!plain || generic_path()) {
    update_running_stats_generic_(running_mean, running_var, mean, unbiased_var, momentum);
    return;
  }
  // As the generic form's copy_ does (autograd checks saved tensors against it); first, so that
  // an inference tensor outside inference mode raises before it is written, as copy_ does.
  running_mean.unsafeGetTensorImpl()->bump_version();
  running_var.unsafeGetTensorImpl()->bump_version();
  AT_DISPATCH_FLOATING_TYPES(dtype, "update_running_stats_", [&] {
    const scalar_t m = static_cast<scalar_t>(momentum);
    const scalar_t keep = scalar_t(1) - m;
    scalar_t* rm = running_mean.data_ptr<scalar_t>();
    scalar_t* rv = running_var.data_ptr<scalar_t>();
    const scalar_t* mu = mean.const_data_ptr<scalar_t>();
    const scalar_t* uv = unbiased_var.const_data_ptr<scalar_t>();
    for (int64_t c = 0; c < C; ++c) {
      const scalar_t fresh = m * mu[c];
      const scalar_t kept = keep * rm[c];
      rm[c] = fresh + kept;
      const double var_term = static_cast<double>(m) * static_cast<double>(uv[c]);
      const scalar_t var_kept = keep * rv[c];
      rv[c] = static_cast<scalar_t>(var_term + static_cast<double>(var_kept));
    }
  });
}
}  // namespace

TORCH_LIBRARY_IMPL(fxfuse, CPU, m) {
  m.impl("update_running_stats_", &update_running_stats_cpu_);
  m.impl("bn_stats", &bn_stats_cpu);
  m.impl("bn_act", &bn_act_cpu);
  m.impl("bn_act_backward", &bn_act_backward_cpu);
  m.impl("bn_act_", &bn_act_cpu_);
  m.impl("bn_act_backward_", &bn_act_backward_cpu_);
  m.impl("bn_act_backward_into_grad_", &bn_act_backward_into_grad_cpu_);
}

}  // namespace fxfuse
