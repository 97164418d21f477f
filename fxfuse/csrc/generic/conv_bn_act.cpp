// Conv2d -> BatchNorm2d (-> activation) that keeps only the conv input for
// backward: the backward op recomputes the convolution, runs the fused
// BN-apply+activation backward, then the convolution backward.
// The conv output is a temporary of these ops, so the BN-apply+activation
// (forward) and its grad_input (backward) are written over it: one activation-sized
// buffer per call instead of two.
// Built from ATen calls plus fxfuse's own ops, so it runs on every device and
// picks the hand-written kernels where a device has them.
#include <torch/library.h>

#include "../bn_act.h"
#include "../cat_input.h"
#include "../conv_ops.h"
#include "../dispatch.h"

namespace fxfuse {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_act(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    bool batch_stats, double eps, c10::string_view act, double act_param) {
  at::Tensor y = conv2d_generic(input, weight, bias, stride, padding, dilation, groups);
  TORCH_CHECK(y.dim() == 4, "fxfuse::conv_bn_act: expected a 4-D (N, C, H, W) input");
  auto [mean, var, unbiased_var] =
      normalization_stats(y, running_mean, running_var, batch_stats, "conv_bn_act");
  dispatch::bn_act_(y, mean, var, bn_weight, bn_bias, eps, act, act_param);
  return {y, mean, var, unbiased_var};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_act_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, const std::optional<at::Tensor>& bn_weight,
    const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean, const at::Tensor& var,
    bool batch_stats, double eps, c10::string_view act, double act_param,
    std::array<bool, 5> output_mask) {
  const bool need_conv_grads = output_mask[0] || output_mask[1] || output_mask[2];
  // Recompute the conv output: the one activation this op did not keep.
  at::Tensor y = conv2d_generic(input, weight, bias, stride, padding, dilation, groups);
  at::Tensor grad_bn_weight, grad_bn_bias;
  if (!need_conv_grads) {
    std::tie(std::ignore, grad_bn_weight, grad_bn_bias) = dispatch::bn_act_backward(
        grad_out, y, mean, var, bn_weight, bn_bias, eps, act, act_param, batch_stats,
        {false, output_mask[3], output_mask[4]});
    return {at::Tensor(), at::Tensor(), at::Tensor(), grad_bn_weight, grad_bn_bias};
  }
  std::tie(grad_bn_weight, grad_bn_bias) = dispatch::bn_act_backward_(
      grad_out, y, mean, var, bn_weight, bn_bias, eps, act, act_param, batch_stats,
      {output_mask[3], output_mask[4]});
  const at::Tensor& grad_y = y;  // bn_act_backward_ wrote grad_y over y
  auto [grad_input, grad_weight, grad_bias] = dispatch::conv2d_backward(
      grad_y, input, weight, bias, stride, padding, dilation, groups,
      {output_mask[0], output_mask[1], output_mask[2]});
  return {grad_input, grad_weight, grad_bias, grad_bn_weight, grad_bn_bias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
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
}

constexpr char kConvBnAct[] = "fxfuse::conv_bn_act";

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("conv_bn_act", &conv_bn_act);
  m.impl("cat_conv_bn_act", &cat_input::Of<decltype(conv_bn_act)>::kernel<kConvBnAct>);
  m.impl("conv_bn_act_backward", &conv_bn_act_backward);
}

}  // namespace fxfuse
