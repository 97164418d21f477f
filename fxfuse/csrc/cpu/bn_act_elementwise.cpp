// Host build of the CUDA kernels (cuda/bn_act_kernel.cu, cuda/bn_act_backward_kernel.cu,
// cuda/bn_stats_kernel.cu): the same layout, coefficients, per-element math and
// per-channel finishing (bn_act_elementwise.h, bn_act_host_setup.h), run by plain serial
// loops, so that the CPU tests check the device formulas against the generic path, the
// in-place forms included. Only the order of the per-channel sums differs from the device.
// Not registered as an op kernel: exposed as torch.ops.fxfuse_elementwise for the tests.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include "../bn_act.h"
#include "../bn_act_elementwise.h"
#include "../activation_ops.h"
#include "../bn_act_host_setup.h"

namespace fxfuse {

namespace ew = elementwise;

namespace {

ew::Layout host_layout(const at::Tensor& input, const char* op) {
  TORCH_CHECK(input.device().is_cpu(), "fxfuse::", op, ": expected CPU tensors");
  const auto lay = ew::layout_of(input);
  TORCH_CHECK(lay.has_value(), "fxfuse::", op, ": expected a contiguous or channels_last input");
  return lay->first;
}

#define FXFUSE_HOST_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

// act(bn(input)) into out (a fresh tensor in the input's layout, or the input itself).
void forward_into(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param, const at::Tensor& out, const char* op) {
  checks::bn_args(input, mean, var, weight, bias, op);
  const Act a = parse_act(act);
  const ew::Layout L = host_layout(input, op);
  const auto cf = ew::coefficients(input, mean, var, weight, bias, eps);
  FXFUSE_HOST_DISPATCH(input.scalar_type(), "bn_act_elementwise_host", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    scalar_t* y = out.mutable_data_ptr<scalar_t>();
    const A *m = cf.mean.const_data_ptr<A>(), *s = cf.scale.const_data_ptr<A>(),
            *b = cf.bias.const_data_ptr<A>();
    for (int64_t i = 0; i < input.numel(); ++i) {
      const int64_t c = L.channel(i);
      y[i] = ew::forward<scalar_t, A>(x[i], m[c], s[c], b[c], a, static_cast<A>(act_param));
    }
  });
}

// bn_act_backward's parameter gradients; grad_input goes to `dst` when it is defined (a
// fresh tensor, the input, or dy: each element of x and dy is read before it is written).
std::tuple<at::Tensor, at::Tensor> backward_into(
    const at::Tensor& dy, const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    Act a, double act_param, bool batch_stats, bool need_weight, bool need_bias,
    const at::Tensor& dst, const ew::Layout& L) {
  const auto cf = ew::coefficients(input, mean, var, weight, bias, eps);
  const int64_t C = L.C, M = L.N * L.HW;
  const bool need_input = dst.defined();
  const bool need_sums = need_weight || need_bias || (need_input && batch_stats);
  ew::BackwardSums sums;
  FXFUSE_HOST_DISPATCH(input.scalar_type(), "bn_act_backward_elementwise_host", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    const scalar_t* d = dy.const_data_ptr<scalar_t>();
    const A *m = cf.mean.const_data_ptr<A>(), *is = cf.invstd.const_data_ptr<A>(),
            *s = cf.scale.const_data_ptr<A>(), *b = cf.bias.const_data_ptr<A>();
    const A p = static_cast<A>(act_param);
    if (need_sums) {
      at::Tensor sum_g = at::empty({C}, cf.mean.options());
      at::Tensor sum_gxm = at::empty({C}, cf.mean.options());
      for (int64_t c = 0; c < C; ++c) {
        A sg = 0, sgxm = 0;
        for (int64_t j = 0; j < M; ++j) {
          const int64_t o = L.offset(c, j);
          ew::backward_terms<scalar_t, A>(d[o], x[o], m[c], s[c], b[c], a, p, sg, sgxm);
        }
        sum_g.mutable_data_ptr<A>()[c] = sg;
        sum_gxm.mutable_data_ptr<A>()[c] = sgxm;
      }
      sums = ew::backward_sums(sum_g, sum_gxm, cf, M, batch_stats);
    }
    if (need_input) {
      const A* k1 = batch_stats ? sums.k1.const_data_ptr<A>() : nullptr;
      const A* k2 = batch_stats ? sums.k2.const_data_ptr<A>() : nullptr;
      scalar_t* gi = dst.mutable_data_ptr<scalar_t>();
      for (int64_t i = 0; i < input.numel(); ++i) {
        const int64_t c = L.channel(i);
        const A g = ew::grad_z<scalar_t, A>(d[i], x[i], m[c], s[c], b[c], a, p);
        gi[i] = ew::grad_input<scalar_t, A>(
            g, x[i], m[c], is[c], s[c], k1 ? k1[c] : A(0), k2 ? k2[c] : A(0), batch_stats);
      }
    }
  });
  return ew::parameter_grads(sums, weight, bias, need_weight, need_bias);
}

at::Tensor dy_like(const at::Tensor& grad_out, const at::Tensor& input) {
  return grad_out.to(input.scalar_type()).contiguous(input.suggest_memory_format());
}

}  // namespace

at::Tensor bn_act_elementwise_host(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  at::Tensor out = at::empty_like(input);
  forward_into(input, mean, var, weight, bias, eps, act, act_param, out, "bn_act_elementwise_host");
  return out;
}

void bn_act_elementwise_host_(
    const at::Tensor& self, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  forward_into(self, mean, var, weight, bias, eps, act, act_param, self, "bn_act_elementwise_host_");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_elementwise_host(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward_elementwise_host");
  const Act a = parse_act(act);
  const ew::Layout L = host_layout(input, "bn_act_backward_elementwise_host");
  at::Tensor grad_input = output_mask[0] ? at::empty_like(input) : at::Tensor();
  auto [grad_weight, grad_bias] = backward_into(
      dy_like(grad_out, input), input, mean, var, weight, bias, eps, a, act_param, batch_stats,
      output_mask[1], output_mask[2], grad_input, L);
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_elementwise_host_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward_elementwise_host_");
  const Act a = parse_act(act);
  const ew::Layout L = host_layout(input, "bn_act_backward_elementwise_host_");
  return backward_into(
      dy_like(grad_out, input), input, mean, var, weight, bias, eps, a, act_param, batch_stats,
      output_mask[0], output_mask[1], input, L);
}

std::tuple<at::Tensor, at::Tensor> bn_act_backward_into_grad_elementwise_host_(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 2> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward_into_grad_elementwise_host_");
  const Act a = parse_act(act);
  const auto lay = ew::layout_of(input);
  const ew::Layout L = host_layout(input, "bn_act_backward_into_grad_elementwise_host_");
  TORCH_CHECK(
      grad_out.scalar_type() == input.scalar_type() && grad_out.is_contiguous(lay->second),
      "fxfuse::bn_act_backward_into_grad_elementwise_host_: expected grad_out in the input's "
      "dtype and layout");
  return backward_into(
      grad_out, input, mean, var, weight, bias, eps, a, act_param, batch_stats, output_mask[0],
      output_mask[1], grad_out, L);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_elementwise_host(const at::Tensor& input) {
  checks::bn_input(input, "bn_stats_elementwise_host");
  const ew::Layout L = host_layout(input, "bn_stats_elementwise_host");
  TORCH_CHECK(input.numel() > 0, "fxfuse::bn_stats_elementwise_host: expected a non-empty input");
  const int64_t C = L.C, M = L.N * L.HW;
  const auto opts = input.options().dtype(stats_dtype(input.scalar_type()));
  at::Tensor mean = at::empty({C}, opts), sum_sq = at::empty({C}, opts);
  FXFUSE_HOST_DISPATCH(input.scalar_type(), "bn_stats_elementwise_host", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    for (int64_t c = 0; c < C; ++c) {
      A s = 0;
      for (int64_t j = 0; j < M; ++j) s += static_cast<A>(x[L.offset(c, j)]);
      const A mu = s / static_cast<A>(M);
      A q = 0;
      for (int64_t j = 0; j < M; ++j) q += ew::centered_square<scalar_t, A>(x[L.offset(c, j)], mu);
      mean.mutable_data_ptr<A>()[c] = mu;
      sum_sq.mutable_data_ptr<A>()[c] = q;
    }
  });
  return ew::stats_from_squares(mean, sum_sq, M);
}

}  // namespace fxfuse
