// a * b + c and c - a * b rounded as ATen's CPU kernels of the same capability round
// them: ATen's AVX2 (and AVX-512) builds are compiled with FMA contraction (one
// rounding), its baseline build has no FMA (two). Kernels that must match eager bit for
// bit (the BatchNorm pre-activation, the activations, GELU) spell their multiply-adds
// with these. Included from a kernel header with CPU_CAPABILITY defined; everything is
// in namespace fxfuse::cpu::CPU_CAPABILITY.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cmath>

#ifndef CPU_CAPABILITY
#error "fma_rounding.h must be included with CPU_CAPABILITY defined"
#endif

namespace fxfuse::cpu::CPU_CAPABILITY {

template <typename T>
inline at::vec::Vectorized<T> madd(
    const at::vec::Vectorized<T>& a, const at::vec::Vectorized<T>& b, const at::vec::Vectorized<T>& c) {
#if defined(CPU_CAPABILITY_AVX2)
  return at::vec::fmadd(a, b, c);
#else
  return a * b + c;
#endif
}

template <typename T>
inline at::vec::Vectorized<T> nmadd(
    const at::vec::Vectorized<T>& a, const at::vec::Vectorized<T>& b, const at::vec::Vectorized<T>& c) {
#if defined(CPU_CAPABILITY_AVX2)
  return at::vec::fnmadd(a, b, c);
#else
  return c - a * b;
#endif
}

template <typename T>
inline T madd(T a, T b, T c) {
#if defined(CPU_CAPABILITY_AVX2)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

template <typename T>
inline T nmadd(T a, T b, T c) {
#if defined(CPU_CAPABILITY_AVX2)
  return std::fma(-a, b, c);
#else
  return c - a * b;
#endif
}

}  // namespace fxfuse::cpu::CPU_CAPABILITY
