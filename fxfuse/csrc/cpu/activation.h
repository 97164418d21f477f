// Vectorized activation functors for the hand-written CPU kernels.
//
// Included by bn_act_kernel_impl.h once per CPU capability (DEFAULT, AVX2), so
// everything lives in namespace fxfuse::cpu::CPU_CAPABILITY and uses that
// capability's at::vec::Vectorized. The formulas are those of ATen's own CPU
// kernels (aten/src/ATen/native/cpu/Activation.cpp), so the results match the
// eager / generic path up to rounding:
//
//   forward                         backward (dy, z = pre-activation)
//   relu       clamp_min(z, 0)      threshold_backward: z <= 0 ? 0 : dy
//   relu6      clamp(z, 0, 6)       hardtanh_backward: (0 < z < 6) ? dy : 0
//   leaky_relu z * (z > 0 ? 1 : s)  dy * (z > 0 ? 1 : s)
//   gelu       erf form             gelu_backward(approximate="none")
//   gelu_tanh  tanh form            gelu_backward(approximate="tanh")
//   silu       z / (1 + exp(-z))    dy * sig * (1 + z * (1 - sig))
//   hardswish  z*min(max(z+3,0),6)/6  z <= -3 ? 0 : z >= 3 ? dy : dy*(z/3 + 1/2)
//
// Forward: ATen's own Vectorized exp/erf/tanh and its FMA rounding (fma_rounding.h), so the
// output is eager's bit for bit (ATen's AVX2 and AVX-512 activation kernels round
// alike; tests/test_bn_bitwise.py). A forward one ulp off would decorrelate fxfuse's
// rounding from eager's in every later layer (tests/test_accuracy.py, efficientnet_b0).
// Backward (VMath): ATen's functions, except for float in the AVX2 build, where exp
// and tanh are inline polynomial versions (Cephes expf / tanhf, within ~2 ulp, same
// handling of NaN and +-inf) and erf is ATen's own Abramowitz-Stegun formula on top
// of that exp. ATen's float versions call out to SLEEF (tanh: ~4 ns per element
// here), which would make the backward, which evaluates act'(z) twice, slower than
// eager; its rounding differences there are smooth and small next to the BN sums'.
//
// Only vector versions exist: the kernels handle remainders with partial
// (masked) loads and stores, so every element goes through the same formula.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cmath>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "../bn_act.h"
#include "fma_rounding.h"

#ifndef CPU_CAPABILITY
#error "activation.h must be included with CPU_CAPABILITY defined (see bn_act_kernel_impl.h)"
#endif

namespace fxfuse::cpu::CPU_CAPABILITY {

// exp, erf, tanh: ATen's by default.
template <typename T>
struct VMath {
  using Vec = at::vec::Vectorized<T>;
  static Vec exp(const Vec& x) { return x.exp(); }
  static Vec erf(const Vec& x) { return x.erf(); }
  // erf(x) given e = exp(-x * x) (which the AVX2 float version reuses).
  static Vec erf_with_exp(const Vec& x, const Vec& /*e*/) { return x.erf(); }
  static Vec tanh(const Vec& x) { return x.tanh(); }
};

#if defined(CPU_CAPABILITY_AVX2)
template <>
struct VMath<float> {
  using Vec = at::vec::Vectorized<float>;

  // Cephes expf: exp(x) = 2^n * exp(r), r = x - n ln2 (ln2 in two parts),
  // degree-6 polynomial for exp(r). Overflow gives +inf, underflow 0 (results
  // below FLT_MIN flush to 0), NaN stays NaN.
  static Vec exp(const Vec& v) {
    const __m256 x = v;
    const __m256 hi = _mm256_set1_ps(88.72283935546875f);
    const __m256 lo = _mm256_set1_ps(-87.33654475f);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 fx = _mm256_floor_ps(
        _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    const __m256 z = _mm256_mul_ps(r, r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, r), one);
    // y * 2^n, as y * 2^(n-1) * 2 so that n = 128 does not overflow the exponent
    const __m256i n1 = _mm256_cvtps_epi32(_mm256_sub_ps(fx, one));
    const __m256 p2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    y = _mm256_mul_ps(_mm256_mul_ps(y, p2), _mm256_set1_ps(2.0f));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }

  // at::vec::Vectorized<float>::erf() (Abramowitz-Stegun 7.1.26) with the exp above.
  static Vec erf(const Vec& v) {
    const __m256 x = v;
    return erf_with_exp(v, exp(Vec(_mm256_xor_ps(_mm256_set1_ps(-0.f), _mm256_mul_ps(x, x)))));
  }
  // The same, given e = exp(-x * x).
  static Vec erf_with_exp(const Vec& v, const Vec& e) {
    const __m256 x = v;
    const __m256 neg_zero = _mm256_set1_ps(-0.f);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_and_ps(neg_zero, x);
    const __m256 ax = _mm256_xor_ps(sign, x);
    const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), ax, one));
    __m256 r = _mm256_fmadd_ps(_mm256_set1_ps(1.061405429f), t, _mm256_set1_ps(-1.453152027f));
    r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(1.421413741f));
    r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(-0.284496736f));
    r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(0.254829592f));
    const __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_xor_ps(neg_zero, e), t), r, one);
    return _mm256_xor_ps(sign, y);
  }

  // Cephes tanhf: odd polynomial for |x| < 0.625, else 1 - 2 / (exp(2|x|) + 1).
  static Vec tanh(const Vec& v) {
    const __m256 x = v;
    const __m256 neg_zero = _mm256_set1_ps(-0.f);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_and_ps(neg_zero, x);
    const __m256 ax = _mm256_xor_ps(sign, x);
    const __m256 e = exp(Vec(_mm256_add_ps(ax, ax)));
    const __m256 big = _mm256_xor_ps(
        sign, _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one))));
    const __m256 s = _mm256_mul_ps(x, x);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(-5.70498872745e-3f), s, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-3.33332819422e-1f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, s), x, x);
    return _mm256_blendv_ps(small, big, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_GE_OQ));
  }
};
#endif  // CPU_CAPABILITY_AVX2

template <Act A, typename T>
struct ActOp;

template <typename T>
struct ActOp<Act::None, T> {
  using Vec = at::vec::Vectorized<T>;
  static Vec fwd(const Vec& z, T /*param*/) { return z; }
  static Vec bwd(const Vec& dy, const Vec& /*z*/, T /*param*/) { return dy; }
};

template <typename T>
struct ActOp<Act::ReLU, T> {
  using Vec = at::vec::Vectorized<T>;
  // at::relu == clamp_min(z, 0); keeps NaN.
  static Vec fwd(const Vec& z, T) { return at::vec::clamp_min(z, Vec(T(0))); }
  // threshold_backward(dy, z, 0): z <= 0 ? 0 : dy (NaN z passes dy through).
  static Vec bwd(const Vec& dy, const Vec& z, T) {
    return Vec::blendv(dy, Vec(T(0)), z <= Vec(T(0)));
  }
};

template <typename T>
struct ActOp<Act::ReLU6, T> {
  using Vec = at::vec::Vectorized<T>;
  // hardtanh(z, 0, 6) == clamp(z, 0, 6); keeps NaN.
  static Vec fwd(const Vec& z, T) { return at::vec::clamp(z, Vec(T(0)), Vec(T(6))); }
  // hardtanh_backward(dy, z, 0, 6), vectorized form of ATen.
  static Vec bwd(const Vec& dy, const Vec& z, T) {
    return ((z > Vec(T(0))) & (z < Vec(T(6)))) & dy;
  }
};

template <typename T>
struct ActOp<Act::LeakyReLU, T> {
  using Vec = at::vec::Vectorized<T>;
  static Vec fwd(const Vec& z, T slope) {
    return z * Vec::blendv(Vec(slope), Vec(T(1)), z > Vec(T(0)));
  }
  static Vec bwd(const Vec& dy, const Vec& z, T slope) {
    return dy * Vec::blendv(Vec(slope), Vec(T(1)), z > Vec(T(0)));
  }
};

template <typename T>
struct ActOp<Act::GELU, T> {
  using Vec = at::vec::Vectorized<T>;
  static Vec fwd(const Vec& z, T) {
    const Vec kAlpha(T(M_SQRT1_2));
    return z * Vec(T(0.5)) * (Vec(T(1)) + (z * kAlpha).erf());
  }
  static Vec bwd(const Vec& dy, const Vec& z, T) {
    const Vec kAlpha(T(M_SQRT1_2));
    const Vec kBeta(T(M_2_SQRTPI * M_SQRT1_2 * 0.5));
    // exp(-z^2 / 2) serves the pdf and (AVX2 float) the erf of z / sqrt(2).
    const Vec e = VMath<T>::exp(z * z * Vec(T(-0.5)));
    const Vec cdf = Vec(T(0.5)) * (Vec(T(1)) + VMath<T>::erf_with_exp(z * kAlpha, e));
    const Vec pdf = kBeta * e;
    return dy * (cdf + z * pdf);
  }
};

template <typename T>
struct ActOp<Act::GELUTanh, T> {
  using Vec = at::vec::Vectorized<T>;
  static Vec fwd(const Vec& z, T) {
    const Vec kBeta(T(M_SQRT2 * M_2_SQRTPI * 0.5));
    const Vec kKappa(T(0.044715));
    const Vec z_cube = z * z * z;
    const Vec inner = kBeta * madd(kKappa, z_cube, z);
    return Vec(T(0.5)) * z * (Vec(T(1)) + inner.tanh());
  }
  static Vec bwd(const Vec& dy, const Vec& z, T) {
    const Vec kBeta(T(M_SQRT2 * M_2_SQRTPI * 0.5));
    const Vec kKappa(T(0.044715));
    const Vec kOne(T(1));
    const Vec kHalf(T(0.5));
    const Vec z_sq = z * z;
    const Vec z_cube = z * z * z;
    const Vec inner = kBeta * (z + kKappa * z_cube);
    const Vec tanh_inner = VMath<T>::tanh(inner);
    const Vec left = kHalf * z;
    const Vec right = kOne + tanh_inner;
    const Vec left_derivative = kHalf * right;
    const Vec tanh_derivative = kOne - tanh_inner * tanh_inner;
    const Vec inner_derivative = kBeta * (kOne + Vec(T(3)) * kKappa * z_sq);
    const Vec right_derivative = left * tanh_derivative * inner_derivative;
    return dy * (left_derivative + right_derivative);
  }
};

template <typename T>
struct ActOp<Act::SiLU, T> {
  using Vec = at::vec::Vectorized<T>;
  static Vec fwd(const Vec& z, T) { return z / (Vec(T(1)) + z.neg().exp()); }
  static Vec bwd(const Vec& dy, const Vec& z, T) {
    const Vec kOne(T(1));
    const Vec sigmoid = kOne / (kOne + VMath<T>::exp(z.neg()));
    return dy * sigmoid * (kOne + z * (kOne - sigmoid));
  }
};

template <typename T>
struct ActOp<Act::Hardswish, T> {
  using Vec = at::vec::Vectorized<T>;
  static Vec fwd(const Vec& z, T) {
    const Vec kSix(T(6));
    return z * at::vec::minimum(at::vec::maximum(z + Vec(T(3)), Vec(T(0))), kSix) / kSix;
  }
  // hardswish_backward: z <= -3 ? 0 : z < 3 ? dy * (z / 3 + 1/2) : dy.
  static Vec bwd(const Vec& dy, const Vec& z, T) {
    const Vec kThree(T(3));
    return Vec::blendv(
        Vec::blendv(dy * ((z / kThree) + Vec(T(0.5))), dy, z >= kThree), Vec(T(0)),
        z <= Vec(T(-3)));
  }
};

}  // namespace fxfuse::cpu::CPU_CAPABILITY
