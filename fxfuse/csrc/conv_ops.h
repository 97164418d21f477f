// fxfuse::conv2d and fxfuse::conv2d_backward. conv2d_backward is the convolution backward
// every fxfuse op that holds a conv runs: ATen's convolution_backward on every device, except
// that on CPU the weight gradient of a large-kernel depthwise convolution comes from fxfuse's
// own kernel (cpu/depthwise_kernel_impl.h). conv2d is F.conv2d (ATen's convolution), whose
// registered autograd (fxfuse/ops/conv2d.py) runs conv2d_backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace fxfuse {

// at::convolution(input, weight, bias, stride, padding, dilation, transposed=false,
// output_padding=0, groups), on every device (generic/conv2d.cpp).
at::Tensor conv2d_generic(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups);

// (grad_input, grad_weight, grad_bias) of at::convolution(input, weight, bias, stride,
// padding, dilation, transposed=false, output_padding=0, groups); grad_bias only when a bias
// is given and output_mask[2]. The device-generic implementation (generic/conv2d_backward.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_generic(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 3> output_mask);

}  // namespace fxfuse
