// Per-element math of BatchNorm-apply + activation, for the CUDA kernels
// (cuda/bn_act_*.cu) and for their host build (cpu/bn_act_elementwise.cpp), which
// the CPU test suite runs against the generic path: the formulas the device
// executes are checked on every machine, GPU or not.
//
// T is the tensor dtype, A the dtype arithmetic runs in (float for half /
// bfloat16 / float, double for double), as in ATen's kernels. The activation
// formulas are those of ATen's activation kernels (and of cpu/activation.h):
//
//   forward                           backward (dy, z = pre-activation)
//   relu       clamp_min(z, 0)        z <= 0 ? 0 : dy
//   relu6      clamp(z, 0, 6)         (z <= 0 || z >= 6) ? 0 : dy
//   leaky_relu z > 0 ? z : z * s      z > 0 ? dy : dy * s
//   gelu       erf form               gelu_backward(approximate="none")
//   gelu_tanh  tanh form              gelu_backward(approximate="tanh")
//   silu       z / (1 + exp(-z))      dy * sig * (1 + z * (1 - sig))
//   hardswish  z*min(max(z+3,0),6)/6  z <= -3 ? 0 : z < 3 ? dy*(z/3 + 1/2) : dy
//              (on the device: * (1.0f / 6.0f), as ATen's CUDA kernel; only a GPU run checks that branch)
//
// Rounding follows eager, which runs batch_norm and the activation as two ops
// that each round their result to T: the pre-activation z is rounded to T before
// the activation, and g = dy * act'(z) is rounded to T before batch norm's
// backward. For float and double these round trips are no-ops.
#pragma once

#include <c10/macros/Macros.h>  // C10_HOST_DEVICE

#include <cmath>
#include <cstdint>

#include "act.h"

namespace fxfuse::elementwise {

C10_HOST_DEVICE inline float exp_(float x) { return ::expf(x); }
C10_HOST_DEVICE inline double exp_(double x) { return ::exp(x); }
C10_HOST_DEVICE inline float erf_(float x) { return ::erff(x); }
C10_HOST_DEVICE inline double erf_(double x) { return ::erf(x); }
C10_HOST_DEVICE inline float tanh_(float x) { return ::tanhf(x); }
C10_HOST_DEVICE inline double tanh_(double x) { return ::tanh(x); }

// 1/sqrt(2), 2/sqrt(pi) / sqrt(2) / 2 = 1/sqrt(2 pi), sqrt(2/pi).
constexpr double kSqrt1_2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kKappa = 0.044715;

template <typename A>
C10_HOST_DEVICE inline A act_forward(Act act, A z, A param) {
  switch (act) {
    case Act::None:
      return z;
    case Act::ReLU:
      return (z != z || z > A(0)) ? z : A(0);
    case Act::ReLU6:
      return z != z ? z : (z < A(0) ? A(0) : (z > A(6) ? A(6) : z));
    case Act::LeakyReLU:
      return z > A(0) ? z : z * param;
    case Act::GELU:
      return z * A(0.5) * (A(1) + erf_(z * A(kSqrt1_2)));
    case Act::GELUTanh: {
      const A inner = A(kSqrt2OverPi) * (z + A(kKappa) * z * z * z);
      return A(0.5) * z * (A(1) + tanh_(inner));
    }
    case Act::SiLU:
      return z / (A(1) + exp_(-z));
    case Act::Hardswish: {
      const A shifted = z + A(3);
      const A clamped = shifted > A(0) ? (shifted < A(6) ? shifted : A(6)) : A(0);
#ifdef __CUDA_ARCH__
      // ATen's CUDA kernel multiplies by the float constant 1.0f / 6.0f, for double too (2^-25
      // relative in float64), where its CPU kernel divides by 6: each device computes what eager
      // computes there.
      return z * clamped * A(1.0f / 6.0f);
#else
      return z * clamped / A(6);
#endif
    }
  }
  return z;
}

// dy * act'(z).
template <typename A>
C10_HOST_DEVICE inline A act_backward(Act act, A dy, A z, A param) {
  switch (act) {
    case Act::None:
      return dy;
    case Act::ReLU:
      return z <= A(0) ? A(0) : dy;
    case Act::ReLU6:
      return (z <= A(0) || z >= A(6)) ? A(0) : dy;
    case Act::LeakyReLU:
      return z > A(0) ? dy : dy * param;
    case Act::GELU: {
      const A cdf = A(0.5) * (A(1) + erf_(z * A(kSqrt1_2)));
      const A pdf = A(kInvSqrt2Pi) * exp_(A(-0.5) * z * z);
      return dy * (cdf + z * pdf);
    }
    case Act::GELUTanh: {
      const A inner = A(kSqrt2OverPi) * (z + A(kKappa) * z * z * z);
      const A t = tanh_(inner);
      const A left_derivative = A(0.5) * (A(1) + t);
      const A inner_derivative = A(kSqrt2OverPi) * (A(1) + A(3) * A(kKappa) * z * z);
      const A right_derivative = A(0.5) * z * (A(1) - t * t) * inner_derivative;
      return dy * (left_derivative + right_derivative);
    }
    case Act::SiLU: {
      const A sig = A(1) / (A(1) + exp_(-z));
      return dy * sig * (A(1) + z * (A(1) - sig));
    }
    case Act::Hardswish:
      return z <= A(-3) ? A(0) : (z < A(3) ? dy * (z / A(3) + A(0.5)) : dy);
  }
  return dy;
}

// v rounded to T and back (a no-op for T == A).
template <typename T, typename A>
C10_HOST_DEVICE inline A round_to(A v) {
  return static_cast<A>(static_cast<T>(v));
}

// act(z) with z = (x - mean) * scale + bias, scale = invstd * weight.
template <typename T, typename A>
C10_HOST_DEVICE inline T forward(T x, A mean, A scale, A bias, Act act, A param) {
  const A z = round_to<T, A>((static_cast<A>(x) - mean) * scale + bias);
  return static_cast<T>(act_forward(act, z, param));
}

// g = dy * act'(z): the gradient reaching batch norm's output.
template <typename T, typename A>
C10_HOST_DEVICE inline A grad_z(T dy, T x, A mean, A scale, A bias, Act act, A param) {
  if (act == Act::None) return static_cast<A>(dy);
  const A z = round_to<T, A>((static_cast<A>(x) - mean) * scale + bias);
  return round_to<T, A>(act_backward(act, static_cast<A>(dy), z, param));
}

// Batch norm's grad_input from g. With batch statistics (k1 = sum(g) / M,
// k2 = sum(g * xhat) / M over the channel's M elements):
//   (g - k1 - xhat * k2) * scale,  xhat = (x - mean) * invstd;
// with fixed (running) statistics: g * scale.
template <typename T, typename A>
C10_HOST_DEVICE inline T grad_input(
    A g, T x, A mean, A invstd, A scale, A k1, A k2, bool batch_stats) {
  if (!batch_stats) return static_cast<T>(g * scale);
  const A xhat = (static_cast<A>(x) - mean) * invstd;
  return static_cast<T>(((g - k1) - xhat * k2) * scale);
}

// One element's terms of the per-channel sums batch norm's backward needs:
// sum(g) and sum(g * (x - mean)) (times invstd once per channel, after the sum).
template <typename T, typename A>
C10_HOST_DEVICE inline void backward_terms(
    T dy, T x, A mean, A scale, A bias, Act act, A param, A& sum_g, A& sum_gxm) {
  const A g = grad_z<T, A>(dy, x, mean, scale, bias, act, param);
  sum_g += g;
  sum_gxm += g * (static_cast<A>(x) - mean);
}

// Layout of a dense 4-D (N, C, H, W) tensor: contiguous NCHW or channels_last.
struct Layout {
  int64_t N, C, HW;
  bool channels_last;

  // Channel of the element at flat offset i.
  C10_HOST_DEVICE int64_t channel(int64_t i) const {
    return channels_last ? i % C : (i / HW) % C;
  }
  // Flat offset of the j-th element (0 <= j < N * HW) of channel c.
  C10_HOST_DEVICE int64_t offset(int64_t c, int64_t j) const {
    const int64_t n = j / HW, hw = j % HW;
    return channels_last ? (n * HW + hw) * C + c : (n * C + c) * HW + hw;
  }
};

}  // namespace fxfuse::elementwise
