// Host build of the CUDA bn_act / bn_act_backward kernels (cuda/bn_act_kernel.cu,
// cuda/bn_act_backward_kernel.cu): the same layout, coefficients and per-element
// math (bn_act_elementwise.h, bn_act_plan.h), run by plain serial loops, so that
// the CPU tests check the device formulas against the generic path. Not registered
// as an op kernel: exposed through fxfuse._C for the tests only.
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

}  // namespace

at::Tensor bn_act_elementwise_host(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& var,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, c10::string_view act, double act_param) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_elementwise_host");
  const Act a = parse_act(act);
  const ew::Layout L = host_layout(input, "bn_act_elementwise_host");
  const auto cf = ew::coefficients(input, mean, var, weight, bias, eps);
  at::Tensor out = at::empty_like(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "bn_act_elementwise_host", [&] {
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
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_act_backward_elementwise_host(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& var, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, c10::string_view act,
    double act_param, bool batch_stats, std::array<bool, 3> output_mask) {
  checks::bn_args(input, mean, var, weight, bias, "bn_act_backward_elementwise_host");
  const Act a = parse_act(act);
  const ew::Layout L = host_layout(input, "bn_act_backward_elementwise_host");
  const auto cf = ew::coefficients(input, mean, var, weight, bias, eps);
  const at::Tensor dy = grad_out.to(input.scalar_type()).contiguous(input.suggest_memory_format());
  const int64_t C = L.C, M = L.N * L.HW;
  const bool need_sums = output_mask[1] || output_mask[2] || (output_mask[0] && batch_stats);
  at::Tensor sum_g, sum_gx, grad_input, grad_weight, grad_bias;

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "bn_act_backward_elementwise_host", [&] {
        using A = at::opmath_type<scalar_t>;
        const scalar_t* x = input.const_data_ptr<scalar_t>();
        const scalar_t* d = dy.const_data_ptr<scalar_t>();
        const A *m = cf.mean.const_data_ptr<A>(), *is = cf.invstd.const_data_ptr<A>(),
                *s = cf.scale.const_data_ptr<A>(), *b = cf.bias.const_data_ptr<A>();
        const A p = static_cast<A>(act_param);
        if (need_sums) {
          sum_g = at::empty({C}, cf.mean.options());
          sum_gx = at::empty({C}, cf.mean.options());
          for (int64_t c = 0; c < C; ++c) {
            A sg = 0, sgxm = 0;
            for (int64_t j = 0; j < M; ++j) {
              const int64_t o = L.offset(c, j);
              const A g = ew::grad_z<scalar_t, A>(d[o], x[o], m[c], s[c], b[c], a, p);
              sg += g;
              sgxm += g * (static_cast<A>(x[o]) - m[c]);
            }
            sum_g.mutable_data_ptr<A>()[c] = sg;
            sum_gx.mutable_data_ptr<A>()[c] = sgxm * is[c];
          }
        }
        if (output_mask[0]) {
          grad_input = at::empty_like(input);
          at::Tensor k1, k2;
          if (batch_stats) {
            k1 = sum_g / static_cast<double>(M);
            k2 = sum_gx / static_cast<double>(M);
          }
          scalar_t* gi = grad_input.mutable_data_ptr<scalar_t>();
          for (int64_t i = 0; i < input.numel(); ++i) {
            const int64_t c = L.channel(i);
            const A g = ew::grad_z<scalar_t, A>(d[i], x[i], m[c], s[c], b[c], a, p);
            gi[i] = ew::grad_input<scalar_t, A>(
                g, x[i], m[c], is[c], s[c], batch_stats ? k1.const_data_ptr<A>()[c] : A(0),
                batch_stats ? k2.const_data_ptr<A>()[c] : A(0), batch_stats);
          }
        }
      });
  if (output_mask[1] && weight.has_value() && weight->defined()) {
    grad_weight = sum_gx.to(weight->scalar_type());
  }
  if (output_mask[2] && bias.has_value() && bias->defined()) grad_bias = sum_g.to(bias->scalar_type());
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace fxfuse
