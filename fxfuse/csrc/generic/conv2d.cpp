// Device-generic conv2d / conv2d_backward: ATen's convolution and convolution_backward.
// Registered as CompositeExplicitAutograd, so they serve CUDA and every other device, and on
// CPU conv2d_backward is the path cpu/conv2d_backward.cpp falls back to for convolutions its
// kernel does not take.
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <torch/library.h>

#include <vector>

#include "../cat_input.h"
#include "../checks.h"
#include "../conv_ops.h"

namespace fxfuse {

at::Tensor conv2d_generic(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  return at::convolution(
      input, weight, bias, stride, padding, dilation, /*transposed=*/false,
      /*output_padding=*/{0, 0}, groups);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_generic(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask) {
  const bool has_bias = checks::given(bias);
  std::vector<int64_t> bias_sizes;
  if (has_bias) bias_sizes = bias->sizes().vec();
  return at::convolution_backward(
      grad_out, input, weight,
      has_bias ? at::OptionalIntArrayRef(bias_sizes) : at::OptionalIntArrayRef(), stride,
      padding, dilation, /*transposed=*/false, /*output_padding=*/{0, 0}, groups,
      {output_mask[0], output_mask[1], output_mask[2] && has_bias});
}

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
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

constexpr char kConv2d[] = "fxfuse::conv2d";

TORCH_LIBRARY_IMPL(fxfuse, CompositeExplicitAutograd, m) {
  m.impl("conv2d", &conv2d_generic);
  m.impl("cat_conv2d", &cat_input::Of<decltype(conv2d_generic)>::kernel<kConv2d>);
  m.impl("conv2d_backward", &conv2d_backward_generic);
}

}  // namespace fxfuse
