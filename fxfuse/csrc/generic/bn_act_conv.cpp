// BatchNorm2d -> activation -> Conv2d (-> BatchNorm2d -> activation) that keeps only the
// first BN's input for backward. The activation output, which the conv would keep for
// its weight gradient, is a temporary: backward rebuilds it with one pointwise pass
// (fxfuse::bn_act, same kernel, same bits) from the BN input and statistics.
//
// With the epilogue (the second BN), the conv output is a temporary too and backward
// recomputes the convolution, as conv_bn_act's does: the op then keeps only the first
// BN's input in place of conv_bn_act's conv input. Both have the activation's size, so
// a chain of such ops saves what a chain of conv_bn_act saves, while convs whose output
// feeds one such op run once.
//
// Built from ATen calls plus fxfuse's own ops, like conv_bn_act, so it runs on every
// device and picks the hand-written BN kernels where a device has them.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../bn_act.h"
#include "../cat_input.h"
#include "../conv_ops.h"
#include "../dispatch.h"

namespace fxfuse {
namespace {

using OptTensor = std::optional<at::Tensor>;

at::Tensor unused_stats(const at::Tensor& like) {
  return at::empty({0}, like.options().dtype(stats_dtype(like.scalar_type())));
}

// (out, in_mean, in_var, in_unbiased_var, mean, var, unbiased_var); the last three are
// empty without the epilogue.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
bn_act_conv(
    const at::Tensor& input, const OptTensor& in_weight, const OptTensor& in_bias,
    const OptTensor& in_running_mean, const OptTensor& in_running_var, bool in_batch_stats,
    double in_eps, c10::string_view in_act, double in_act_param, const at::Tensor& weight,
    const OptTensor& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, bool epilogue, const OptTensor& bn_weight,
    const OptTensor& bn_bias, const OptTensor& running_mean, const OptTensor& running_var,
    bool batch_stats, double eps, c10::string_view act, double act_param) {
  auto [in_mean, in_var, in_unbiased_var] =
      normalization_stats(input, in_running_mean, in_running_var, in_batch_stats, "bn_act_conv");
  at::Tensor y = conv2d_generic(
      dispatch::bn_act(input, in_mean, in_var, in_weight, in_bias, in_eps, in_act, in_act_param),
      weight, bias, stride, padding, dilation, groups);
  if (!epilogue) {
    return {y, in_mean, in_var, in_unbiased_var, unused_stats(y), unused_stats(y), unused_stats(y)};
  }
  TORCH_CHECK(y.dim() == 4, "fxfuse::bn_act_conv: expected a 4-D (N, C, H, W) input");
  auto [mean, var, unbiased_var] =
      normalization_stats(y, running_mean, running_var, batch_stats, "bn_act_conv");
  dispatch::bn_act_(y, mean, var, bn_weight, bn_bias, eps, act, act_param);
  return {y, in_mean, in_var, in_unbiased_var, mean, var, unbiased_var};
}

// Gradients of (input, in_weight, in_bias, weight, bias, bn_weight, bn_bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
bn_act_conv_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const OptTensor& in_weight,
    const OptTensor& in_bias, const at::Tensor& in_mean, const at::Tensor& in_var,
    bool in_batch_stats, double in_eps, c10::string_view in_act, double in_act_param,
    const at::Tensor& weight, const OptTensor& bias, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool epilogue,
    const OptTensor& bn_weight, const OptTensor& bn_bias, const at::Tensor& mean,
    const at::Tensor& var, bool batch_stats, double eps, c10::string_view act, double act_param,
    std::array<bool, 7> output_mask) {
  const bool need_prologue = output_mask[0] || output_mask[1] || output_mask[2];
  const bool need_conv = need_prologue || output_mask[3] || output_mask[4];
  // The conv input: the activation output this op did not keep.
  at::Tensor x = dispatch::bn_act(input, in_mean, in_var, in_weight, in_bias, in_eps, in_act, in_act_param);
  at::Tensor grad_y = grad_out, grad_bn_weight, grad_bn_bias;
  if (epilogue) {
    at::Tensor y = conv2d_generic(x, weight, bias, stride, padding, dilation, groups);
    if (need_conv) {
      std::tie(grad_bn_weight, grad_bn_bias) = dispatch::bn_act_backward_(
          grad_out, y, mean, var, bn_weight, bn_bias, eps, act, act_param, batch_stats,
          {output_mask[5], output_mask[6]});
      grad_y = y;  // bn_act_backward_ wrote the conv output's gradient over y
    } else {
      std::tie(std::ignore, grad_bn_weight, grad_bn_bias) = dispatch::bn_act_backward(
          grad_out, y, mean, var, bn_weight, bn_bias, eps, act, act_param, batch_stats,
          {false, output_mask[5], output_mask[6]});
    }
  }
  if (!need_conv) {
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            grad_bn_weight, grad_bn_bias};
  }
  auto [grad_x, grad_weight, grad_bias] = dispatch::conv2d_backward(
      grad_y, x, weight, bias, stride, padding, dilation, groups,
      {need_prologue, output_mask[3], output_mask[4]});
  x.reset();
  grad_y.reset();
  at::Tensor grad_input, grad_in_weight, grad_in_bias;
  if (output_mask[0]) {
    // grad_x is ours: the prologue's grad_input goes over it. The CPU and CUDA kernels do
    // this truly in place; the generic form holds what eager's backward holds (g and
    // grad_input) and copies.
    std::tie(grad_in_weight, grad_in_bias) = dispatch::bn_act_backward_into_grad_(
        grad_x, input, in_mean, in_var, in_weight, in_bias, in_eps, in_act, in_act_param,
        in_batch_stats, {output_mask[1], output_mask[2]});
    grad_input = std::move(grad_x);
  } else if (need_prologue) {
    std::tie(grad_input, grad_in_weight, grad_in_bias) = dispatch::bn_act_backward(
        grad_x, input, in_mean, in_var, in_weight, in_bias, in_eps, in_act, in_act_param,
        in_batch_stats, {false, output_mask[1], output_mask[2]});
  }
  return {grad_input, grad_in_weight, grad_in_bias, grad_weight, grad_bias, grad_bn_weight,
          grad_bn_bias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
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
}

constexpr char kBnActConv[] = "fxfuse::bn_act_conv";

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("bn_act_conv", &bn_act_conv);
  m.impl("cat_bn_act_conv", &cat_input::Of<decltype(bn_act_conv)>::kernel<kBnActConv>);
  m.impl("bn_act_conv_backward", &bn_act_conv_backward);
}

}  // namespace fxfuse
