// Host build of the CUDA kernels (cuda/bn_stats_kernel.cu, cuda/bn_act_kernel.cu,
// cuda/bn_act_backward_kernel.cu): the same host logic (bn_act_host_setup.h), per-channel
// math and vector units (bn_act_device.h) and per-element math (bn_act_elementwise.h), with
// each kernel launch replaced by a serial loop over what the device's threads do, so that
// the CPU tests check the device's formulas and walks against the generic path, the
// in-place forms included. The split reductions use three splits (the device: about four
// blocks per SM), so the finalizes' merges run too; only the order of the per-thread sums
// within a split differs from the device.
// Not registered as an op kernel: exposed as torch.ops.fxfuse_elementwise for the tests.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "../bn_act.h"
#include "../bn_act_device.h"
#include "../bn_act_elementwise.h"
#include "../bn_act_host_setup.h"
#include "../bn_act_kernels.h"

namespace fxfuse {

namespace ew = elementwise;

namespace {

constexpr int64_t kHostSplits = 3;

void host_only(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "fxfuse_elementwise: the host build expects CPU tensors");
}

#define FXFUSE_HOST_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

template <typename A>
A* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<A>() : nullptr;
}

// The elementwise kernels' walk, one thread's units after another.
template <typename T, typename A>
void forward_walk(
    const ew::Layout& L, int64_t n, const T* x, T* y, const ew::ChannelParams<A>& p, Act a,
    A ap) {
  constexpr int V = ew::kVec<T>;
  switch (ew::choose_walk<T>(L, x, y, y)) {
    case ew::Walk::Plane: {
      ew::CoefCache<A, V, false, false> cache;
      for (int64_t i = 0; i < n; i += V) ew::forward_unit<T, A, V, false>(x, y, i, L.channel(i), p, cache, a, ap);
      break;
    }
    case ew::Walk::Pixel: {
      ew::CoefCache<A, V, true, false> cache;
      for (int64_t i = 0; i < n; i += V) ew::forward_unit<T, A, V, true>(x, y, i, i % L.C, p, cache, a, ap);
      break;
    }
    case ew::Walk::Scalar: {
      ew::CoefCache<A, 1, false, false> cache;
      for (int64_t i = 0; i < n; ++i) ew::forward_unit<T, A, 1, false>(x, y, i, L.channel(i), p, cache, a, ap);
      break;
    }
  }
}

template <typename T, typename A>
void grad_input_walk(
    const ew::Layout& L, int64_t n, const T* dy, const T* x, T* dst,
    const ew::ChannelParams<A>& p, const A* k, bool batch_stats, Act a, A ap) {
  constexpr int V = ew::kVec<T>;
  switch (ew::choose_walk<T>(L, dy, x, dst)) {
    case ew::Walk::Plane: {
      ew::CoefCache<A, V, false, true> cache;
      for (int64_t i = 0; i < n; i += V) {
        ew::grad_input_unit<T, A, V, false>(dy, x, dst, i, L.channel(i), p, k, L.C, batch_stats, cache, a, ap);
      }
      break;
    }
    case ew::Walk::Pixel: {
      ew::CoefCache<A, V, true, true> cache;
      for (int64_t i = 0; i < n; i += V) {
        ew::grad_input_unit<T, A, V, true>(dy, x, dst, i, i % L.C, p, k, L.C, batch_stats, cache, a, ap);
      }
      break;
    }
    case ew::Walk::Scalar: {
      ew::CoefCache<A, 1, false, true> cache;
      for (int64_t i = 0; i < n; ++i) {
        ew::grad_input_unit<T, A, 1, false>(dy, x, dst, i, L.channel(i), p, k, L.C, batch_stats, cache, a, ap);
      }
      break;
    }
  }
}

}  // namespace

template <>
BatchStats HostKernels::stats(
    const at::Tensor& input, const ew::Layout& L, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps, bool with_invstd) {
  host_only(input);
  const auto sd = stats_dtype(input.scalar_type());
  const auto acc = input.options().dtype(sd);
  const int64_t C = L.C, M = L.N * L.HW;
  const ew::Splits sp = ew::make_splits(M, kHostSplits);
  const at::Tensor partial = at::empty({sp.count, 2, C}, acc);
  BatchStats out{
      at::empty({C}, acc), with_invstd ? at::empty({C}, acc) : at::Tensor(), at::empty({C}, acc),
      at::empty({C}, acc)};
  FXFUSE_HOST_DISPATCH(input.scalar_type(), "bn_stats_host", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    A* part = partial.mutable_data_ptr<A>();
    for (int64_t s = 0; s < sp.count; ++s) {  // the reduction kernel
      for (int64_t c = 0; c < C; ++c) {
        ew::Welford<A> w;
        for (int64_t j = s * sp.chunk; j < s * sp.chunk + sp.size(s); ++j) {
          w.add(static_cast<A>(x[L.offset(c, j)]));
        }
        part[ew::Splits::at(s, 0, C, c)] = w.value(0);
        part[ew::Splits::at(s, 1, C, c)] = w.value(1);
      }
    }
    auto finalize = [&](auto* rm, auto* rv) {  // the finalize kernel
      using S = std::remove_pointer_t<decltype(rm)>;
      const ew::StatsOut<A, S> o{
          out.mean.mutable_data_ptr<A>(), out.var.mutable_data_ptr<A>(),
          out.unbiased_var.mutable_data_ptr<A>(), ptr_or_null<A>(out.invstd), rm, rv,
          static_cast<A>(eps), ew::bessel_factor<A>(M), static_cast<A>(momentum)};
      for (int64_t c = 0; c < C; ++c) ew::finalize_stats_channel<A, S>(part, sp, C, c, o);
    };
    if (!checks::given(running_mean)) {
      finalize(static_cast<A*>(nullptr), static_cast<A*>(nullptr));
    } else if (running_mean->scalar_type() == sd) {
      finalize(running_mean->mutable_data_ptr<A>(), running_var->mutable_data_ptr<A>());
    } else {
      finalize(running_mean->mutable_data_ptr<scalar_t>(), running_var->mutable_data_ptr<scalar_t>());
    }
  });
  return out;
}

template <>
void HostKernels::apply(
    const at::Tensor& input, const ew::Layout& L, const at::Tensor& mean, const at::Tensor& spread,
    bool spread_is_var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, Act act, double act_param,
    const at::Tensor& out) {
  host_only(input);
  FXFUSE_HOST_DISPATCH(input.scalar_type(), "bn_act_host", [&] {
    using A = at::opmath_type<scalar_t>;
    const ew::HeldParams<A> held(input, mean, spread, spread_is_var, weight, bias, eps);
    forward_walk<scalar_t, A>(
        L, input.numel(), input.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
        held.params, act, static_cast<A>(act_param));
  });
}

template <>
std::tuple<at::Tensor, at::Tensor> HostKernels::backward(
    const at::Tensor& dy, const at::Tensor& input, const ew::Layout& L, const at::Tensor& mean,
    const at::Tensor& spread, bool spread_is_var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, Act act, double act_param,
    bool batch_stats, bool need_weight, bool need_bias, const at::Tensor& dst) {
  host_only(input);
  const auto acc = input.options().dtype(stats_dtype(input.scalar_type()));
  const int64_t C = L.C, M = L.N * L.HW;
  const bool need_input = dst.defined();
  const at::Tensor grad_weight = ew::grad_buffer(weight, need_weight, acc, C);
  const at::Tensor grad_bias = ew::grad_buffer(bias, need_bias, acc, C);
  const at::Tensor k = need_input && batch_stats ? at::empty({2, C}, acc) : at::Tensor();
  const bool need_sums = grad_weight.defined() || grad_bias.defined() || k.defined();
  FXFUSE_HOST_DISPATCH(input.scalar_type(), "bn_act_backward_host", [&] {
    using A = at::opmath_type<scalar_t>;
    const ew::HeldParams<A> held(input, mean, spread, spread_is_var, weight, bias, eps);
    const A ap = static_cast<A>(act_param);
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    const scalar_t* d = dy.const_data_ptr<scalar_t>();
    if (need_sums) {
      const ew::Splits sp = ew::make_splits(M, kHostSplits);
      const at::Tensor partial = at::empty({sp.count, 2, C}, acc);
      A* part = partial.mutable_data_ptr<A>();
      for (int64_t s = 0; s < sp.count; ++s) {  // the reduction kernel
        for (int64_t c = 0; c < C; ++c) {
          const ew::ChannelCoef<A> cf = ew::channel_coef(held.params, c);
          ew::Sums<A> sums;
          for (int64_t j = s * sp.chunk; j < s * sp.chunk + sp.size(s); ++j) {
            const int64_t o = L.offset(c, j);
            ew::backward_terms<scalar_t, A>(d[o], x[o], cf.mean, cf.scale, cf.bias, act, ap, sums.a, sums.b);
          }
          part[ew::Splits::at(s, 0, C, c)] = sums.value(0);
          part[ew::Splits::at(s, 1, C, c)] = sums.value(1);
        }
      }
      const ew::BackwardOut<A> o{ptr_or_null<A>(grad_weight), ptr_or_null<A>(grad_bias), ptr_or_null<A>(k)};
      for (int64_t c = 0; c < C; ++c) ew::finalize_backward_channel<A>(part, sp, C, c, held.params, o);
    }
    if (need_input) {
      grad_input_walk<scalar_t, A>(
          L, input.numel(), d, x, dst.mutable_data_ptr<scalar_t>(), held.params,
          k.defined() ? k.const_data_ptr<A>() : nullptr, batch_stats, act, ap);
    }
  });
  return {ew::in_param_dtype(grad_weight, weight), ew::in_param_dtype(grad_bias, bias)};
}

template <>
void HostKernels::update_running_stats(
    const at::Tensor& running_mean, const at::Tensor& running_var, const at::Tensor& mean,
    const at::Tensor& unbiased_var, double momentum) {
  host_only(running_mean);
  FXFUSE_HOST_DISPATCH(running_mean.scalar_type(), "update_running_stats_host", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto ad = c10::CppTypeToScalarType<A>::value;
    const at::Tensor m = ew::in_dtype(mean, ad), u = ew::in_dtype(unbiased_var, ad);
    const A* mp = m.const_data_ptr<A>();
    const A* up = u.const_data_ptr<A>();
    scalar_t* rm = running_mean.mutable_data_ptr<scalar_t>();
    scalar_t* rv = running_var.mutable_data_ptr<scalar_t>();
    for (int64_t c = 0; c < running_mean.numel(); ++c) {
      rm[c] = ew::running_update<scalar_t, A>(rm[c], mp[c], static_cast<A>(momentum));
      rv[c] = ew::running_update<scalar_t, A>(rv[c], up[c], static_cast<A>(momentum));
    }
  });
}

BatchStats bn_stats_update_host(
    const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps) {
  return ew::stats_update<HostKernels>(input, running_mean, running_var, momentum, eps);
}

// ---- the op kernels' host build (bn_act.h), for torch.ops.fxfuse_elementwise ----

at::Tensor bn_act_elementwise_host(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  return ew::bn_act_op<HostKernels>(input, mean, var, weight, bias, eps, act, act_param);
}

void bn_act_elementwise_host_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  ew::bn_act_op_<HostKernels>(self, mean, var, weight, bias, eps, act, act_param);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_elementwise_host(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask) {
  return ew::bn_act_backward_op<HostKernels>(
      grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask);
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_elementwise_host_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  return ew::bn_act_backward_op_<HostKernels>(
      grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask,
      false);
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_elementwise_host_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  return ew::bn_act_backward_op_<HostKernels>(
      grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask,
      true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_elementwise_host(const at::Tensor& input) {
  return ew::bn_stats_op<HostKernels>(input);
}

void update_running_stats_elementwise_host_(
    at::Tensor& running_mean, at::Tensor& running_var, const at::Tensor& mean,
    const at::Tensor& unbiased_var, double momentum) {
  ew::update_running_stats_op<HostKernels>(running_mean, running_var, mean, unbiased_var, momentum);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_stats_update_elementwise_host(
    const at::Tensor& input, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps) {
  // Tensor? arguments arrive as copies of the caller's handles: the update is still in place.
  const BatchStats s = bn_stats_update_host(input, running_mean, running_var, momentum, eps);
  return {s.mean, s.invstd, s.var, s.unbiased_var};
}

at::Tensor bn_act_invstd_elementwise_host(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    c10::string_view act, double act_param) {
  checks::bn_args(input, mean, invstd, weight, bias, "bn_act_invstd");
  const Act a = parse_act(act);
  const auto layout = ew::layout_of(input);
  if (!layout || input.numel() == 0) ew::unsupported("bn_act_invstd");
  at::Tensor out = at::empty_like(input);
  HostKernels::apply(input, layout->first, mean, invstd, false, weight, bias, 0.0, a, act_param, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_invstd_elementwise_host(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, c10::string_view act, double act_param,
    bool batch_stats, std::array<bool, 3> output_mask) {
  checks::bn_args(input, mean, invstd, weight, bias, "bn_act_backward_invstd");
  const Act a = parse_act(act);
  const auto L = ew::backward_layout(grad_out, input);
  if (!L) ew::unsupported("bn_act_backward_invstd");
  at::Tensor grad_input = output_mask[0] ? at::empty_like(input) : at::Tensor();
  auto [grad_weight, grad_bias] = HostKernels::backward(
      ew::dy_like(grad_out, input), input, *L, mean, invstd, false, weight, bias, 0.0, a,
      act_param, batch_stats, output_mask[1], output_mask[2], grad_input);
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace fxfuse
