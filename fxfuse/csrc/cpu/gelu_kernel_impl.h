// Vectorized, multi-threaded CPU kernel bodies for gelu / gelu_backward over a
// flat array. Compiled once per CPU capability: include this header from exactly
// one translation unit per capability, with CPU_CAPABILITY defined to its name
// (DEFAULT or AVX2) and, for AVX2, CPU_CAPABILITY_AVX2 and a matching target ISA.
// Everything lives in namespace fxfuse::cpu::CPU_CAPABILITY (helpers in an
// anonymous namespace inside it), so the builds never share a symbol.
//
// Numerics: these kernels reproduce ATen's own GELU kernels
// (aten/src/ATen/native/cpu/Activation.cpp: GeluKernelImpl, GeluBackwardKernelImpl)
// operation by operation, so that on the CPU capability ATen runs they return the
// very values at::gelu and at::gelu_backward return:
//  * the same formulas, with ATen's Vectorized exp / erf / tanh (SLEEF) in the
//    vector part and libm's in the scalar part;
//  * the same fused multiply-adds: ATen's AVX2 kernels are built with GCC's
//    default -ffp-contract=fast, which fuses some of the a * b + c (those of the
//    torch 2.14 wheels, read off their disassembly, differ between the vector and
//    the scalar formulas). This extension is built with -ffp-contract=off, so
//    they are written out here: madd / nmadd, which are plain multiply and add in
//    the DEFAULT build, as in ATen's (baseline x86-64 has no FMA);
//  * the same work split: cpu_kernel_vec cuts the range into at::parallel_for
//    chunks (same grain sizes as below), runs each chunk two vectors at a time and
//    finishes its last < 2 vectors with the scalar formulas.
// This matters for gelu_backward(approximate="tanh") in float32, where
// 1 - tanh(u)^2 cancels: one ulp of tanh moves the result by up to ~5e-6, so "close
// to ATen" is only reachable by computing what ATen computes. (On CPUs where ATen
// runs its AVX512 kernels the agreement is to rounding, not bitwise.) Float32
// erf-GELU reaches these bodies only with oneDNN disabled: the entry points
// (gelu_kernel.cpp) otherwise run oneDNN's kernel, as ATen does.
// Deliberately independent of activation.h, whose functors trade this exactness
// for speed (inline exp/tanh).
#pragma once

#ifndef CPU_CAPABILITY
#error "gelu_kernel_impl.h must be included with CPU_CAPABILITY defined"
#endif

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fma_rounding.h"
#include "gelu_kernel.h"

namespace fxfuse::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// GeluKernelImpl's grain: ATen's default up to 16384 elements, else one chunk per thread.
inline int64_t forward_grain(int64_t n) {
  constexpr int64_t kMinElementsForMultiThreading = 16384;
  return n > kMinElementsForMultiThreading
      ? std::max<int64_t>(1, n / at::get_num_threads())
      : at::internal::GRAIN_SIZE;
}

// GeluBackwardKernelImpl uses cpu_kernel_vec's default grain.
constexpr int64_t kBackwardGrain = at::internal::GRAIN_SIZE;

// Constants as ATen spells them (computed in double, rounded once to T).
template <typename T>
struct K {
  static constexpr T kAlpha = T(M_SQRT1_2);                     // 1 / sqrt(2)
  static constexpr T kBetaErf = T(M_2_SQRTPI * M_SQRT1_2 * 0.5);  // 1 / sqrt(2 pi)
  static constexpr T kBetaTanh = T(M_SQRT2 * M_2_SQRTPI * 0.5);   // sqrt(2 / pi)
  static constexpr T kKappa = T(0.044715);
};

// ---- erf form ----

template <typename T>
struct GeluErf {
  using Vec = Vectorized<T>;
  static Vec fwd(const Vec& x) {
    return x * Vec(T(0.5)) * (Vec(T(1)) + (x * Vec(K<T>::kAlpha)).erf());
  }
  static T fwd(T x) { return x * T(0.5) * (T(1) + std::erf(x * K<T>::kAlpha)); }

  static Vec bwd(const Vec& dy, const Vec& x) {
    const Vec cdf = Vec(T(0.5)) * (Vec(T(1)) + (x * Vec(K<T>::kAlpha)).erf());
    const Vec pdf = Vec(K<T>::kBetaErf) * (x * x * Vec(T(-0.5))).exp();
    return dy * madd(x, pdf, cdf);
  }
  static T bwd(T dy, T x) {
    const T one_plus_erf = T(1) + std::erf(x * K<T>::kAlpha);
    const T pdf = K<T>::kBetaErf * std::exp(x * x * T(-0.5));
    return dy * madd(T(0.5), one_plus_erf, x * pdf);
  }
};

// ---- tanh approximation ----

template <typename T>
struct GeluTanh {
  using Vec = Vectorized<T>;
  static Vec fwd(const Vec& x) {
    const Vec x_cube = x * x * x;
    const Vec inner = Vec(K<T>::kBetaTanh) * madd(Vec(K<T>::kKappa), x_cube, x);
    return Vec(T(0.5)) * x * (Vec(T(1)) + inner.tanh());
  }
  static T fwd(T x) {
    const T x_cube = x * x * x;
    const T inner = K<T>::kBetaTanh * madd(K<T>::kKappa, x_cube, x);
    return T(0.5) * x * (T(1) + std::tanh(inner));
  }

  static Vec bwd(const Vec& dy, const Vec& x) {
    const Vec kOne(T(1));
    const Vec kHalf(T(0.5));
    const Vec x_sq = x * x;
    const Vec x_cube = x_sq * x;
    const Vec inner = Vec(K<T>::kBetaTanh) * madd(Vec(K<T>::kKappa), x_cube, x);
    const Vec tanh_inner = inner.tanh();
    const Vec left = kHalf * x;
    const Vec right = kOne + tanh_inner;
    const Vec tanh_derivative = nmadd(tanh_inner, tanh_inner, kOne);
    const Vec inner_derivative =
        Vec(K<T>::kBetaTanh) * madd(Vec(T(3)) * Vec(K<T>::kKappa), x_sq, kOne);
    const Vec right_derivative = left * tanh_derivative * inner_derivative;
    return dy * madd(kHalf, right, right_derivative);
  }
  static T bwd(T dy, T x) {
    const T x_sq = x * x;
    const T x_cube = x_sq * x;
    const T inner = K<T>::kBetaTanh * madd(K<T>::kKappa, x_cube, x);
    const T tanh_inner = std::tanh(inner);
    const T left = T(0.5) * x;
    const T right = T(1) + tanh_inner;
    const T tanh_derivative = nmadd(tanh_inner, tanh_inner, T(1));
    const T inner_derivative = K<T>::kBetaTanh * madd(T(3) * K<T>::kKappa, x_sq, T(1));
    const T right_derivative = left * tanh_derivative * inner_derivative;
    return dy * madd(T(0.5), right, right_derivative);
  }
};

template <bool kTanh, typename T>
using GeluOp = std::conditional_t<kTanh, GeluTanh<T>, GeluErf<T>>;

// ---- kernels ----

template <bool kTanh, typename T>
void forward_impl(const T* x, T* out, int64_t n) {
  using Vec = Vectorized<T>;
  using Op = GeluOp<kTanh, T>;
  constexpr int64_t VS = Vec::size();
  at::parallel_for(0, n, forward_grain(n), [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 2 * VS <= end; i += 2 * VS) {
      const Vec y0 = Op::fwd(Vec::loadu(x + i));
      const Vec y1 = Op::fwd(Vec::loadu(x + i + VS));
      y0.store(out + i);
      y1.store(out + i + VS);
    }
    for (; i < end; ++i) out[i] = Op::fwd(x[i]);
  });
}

template <bool kTanh, typename T>
void backward_impl(const T* dy, const T* x, T* gi, int64_t n) {
  using Vec = Vectorized<T>;
  using Op = GeluOp<kTanh, T>;
  constexpr int64_t VS = Vec::size();
  at::parallel_for(0, n, kBackwardGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 2 * VS <= end; i += 2 * VS) {
      const Vec g0 = Op::bwd(Vec::loadu(dy + i), Vec::loadu(x + i));
      const Vec g1 = Op::bwd(Vec::loadu(dy + i + VS), Vec::loadu(x + i + VS));
      g0.store(gi + i);
      g1.store(gi + i + VS);
    }
    for (; i < end; ++i) gi[i] = Op::bwd(dy[i], x[i]);
  });
}

template <typename T>
void forward_kernel(const T* x, T* out, int64_t n, bool tanh) {
  if (tanh) {
    forward_impl<true>(x, out, n);
  } else {
    forward_impl<false>(x, out, n);
  }
}

template <typename T>
void backward_kernel(const T* dy, const T* x, T* gi, int64_t n, bool tanh) {
  if (tanh) {
    backward_impl<true>(dy, x, gi, n);
  } else {
    backward_impl<false>(dy, x, gi, n);
  }
}

}  // namespace

template <typename T>
const GeluKernelTable<T>& gelu_kernels() {
  static const GeluKernelTable<T> table{&forward_kernel<T>, &backward_kernel<T>};
  return table;
}

template const GeluKernelTable<float>& gelu_kernels<float>();
template const GeluKernelTable<double>& gelu_kernels<double>();

}  // namespace fxfuse::cpu::CPU_CAPABILITY
