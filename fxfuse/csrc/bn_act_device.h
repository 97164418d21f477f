// What the CUDA kernels of the BatchNorm-apply + activation family run per channel and per
// memory access, for the device (cuda/*.cu) and for their host build
// (cpu/bn_act_elementwise.cpp, which the CPU tests run): the per-channel coefficients
// computed inside the kernels from (mean, var or invstd, weight, bias), the statistics'
// Welford accumulation and the finalize that merges the split reduction's partials and
// updates the running statistics, the backward reduction's finalize, and the vector
// (16-byte) units the elementwise kernels walk. Per-element math: bn_act_elementwise.h.
//
// Running statistics follow eager's CUDA batch_norm (ATen's batch_norm_update_stats in
// Normalization.cu), in A = float for half / bfloat16 / float and double for double:
//   running_mean = S(mean * momentum + (1 - momentum) * running_mean)
//   running_var  = S(var * bessel * momentum + (1 - momentum) * running_var)
// with momentum = A(momentum), bessel = A(double(M) / double(M - 1)), S the running dtype.
// nvcc contracts these multiply-adds into FMAs as it does ATen's (same expression, same
// default --fmad=true); the host build rounds each operation, so the two can differ in the
// last bit of a float running statistic (tests/test_bn_act_elementwise.py bounds it).
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "bn_act_elementwise.h"

#if defined(__CUDACC__)
#define FXFUSE_UNROLL _Pragma("unroll")
#else
#define FXFUSE_UNROLL
#endif

namespace fxfuse::elementwise {

C10_HOST_DEVICE inline float sqrt_(float x) { return ::sqrtf(x); }
C10_HOST_DEVICE inline double sqrt_(double x) { return ::sqrt(x); }

// 1 / sqrt(var + eps), 0 where both are 0 (ATen's InvStd).
template <typename A>
C10_HOST_DEVICE inline A invstd_of(A var, A eps) {
  return (var != A(0) || eps != A(0)) ? A(1) / sqrt_(var + eps) : A(0);
}

// Per-channel inputs of the apply and grad-input kernels, C-vectors in A. `spread` is the
// variance (invstd computed in the kernel with eps) or invstd itself; weight and bias may
// be null (1 and 0).
template <typename A>
struct ChannelParams {
  const A* mean;
  const A* spread;
  const A* weight;
  const A* bias;
  A eps;
  bool spread_is_var;
};

// z = (x - mean) * scale + bias, scale = invstd * weight (eager's training coefficients).
template <typename A>
struct ChannelCoef {
  A mean, invstd, scale, bias;
};

template <typename A>
C10_HOST_DEVICE inline ChannelCoef<A> channel_coef(const ChannelParams<A>& p, int64_t c) {
  ChannelCoef<A> k;
  k.mean = p.mean[c];
  k.invstd = p.spread_is_var ? invstd_of(p.spread[c], p.eps) : p.spread[c];
  k.scale = p.weight != nullptr ? k.invstd * p.weight[c] : k.invstd;
  k.bias = p.bias != nullptr ? p.bias[c] : A(0);
  return k;
}

// ---- statistics ----

// Welford's running mean and sum of squared deviations; merge() is Chan's pairwise update.
template <typename A>
struct Welford {
  A mean = A(0), m2 = A(0);
  int64_t n = 0;

  C10_HOST_DEVICE void add(A x) {
    ++n;
    const A d = x - mean;
    mean += d / static_cast<A>(n);
    m2 += d * (x - mean);
  }
  C10_HOST_DEVICE void merge(const Welford& o) {
    if (o.n == 0) return;
    if (n == 0) {
      *this = o;
      return;
    }
    const int64_t total = n + o.n;
    const A d = o.mean - mean;
    const A wb = static_cast<A>(o.n) / static_cast<A>(total);
    mean += d * wb;
    m2 += o.m2 + d * d * static_cast<A>(n) * wb;
    n = total;
  }
  // What a split stores of it (its count follows from the split's size).
  C10_HOST_DEVICE A value(int k) const { return k == 0 ? mean : m2; }
};

// The backward reduction's accumulator: sum(g) and sum(g * (x - mean)).
template <typename A>
struct Sums {
  A a = A(0), b = A(0);
  C10_HOST_DEVICE void merge(const Sums& o) {
    a += o.a;
    b += o.b;
  }
  C10_HOST_DEVICE A value(int k) const { return k == 0 ? a : b; }
};

// The split reduction's layout: split s sums elements [s * chunk, min(M, (s + 1) * chunk))
// of each channel into partial[s][k][c] (k: the accumulator's two values).
struct Splits {
  int64_t M, chunk, count;
  C10_HOST_DEVICE int64_t size(int64_t s) const {
    const int64_t rest = M - s * chunk;
    return rest < chunk ? rest : chunk;
  }
  C10_HOST_DEVICE static int64_t at(int64_t s, int k, int64_t C, int64_t c) {
    return (s * 2 + k) * C + c;
  }
};

inline Splits make_splits(int64_t M, int64_t wanted) {
  wanted = wanted < 1 ? 1 : (wanted > M ? M : wanted);
  const int64_t chunk = (M + wanted - 1) / wanted;
  return {M, chunk, (M + chunk - 1) / chunk};
}

template <typename S, typename A>
C10_HOST_DEVICE inline S running_update(S running, A batch, A momentum) {
  return static_cast<S>(batch * momentum + (A(1) - momentum) * static_cast<A>(running));
}

template <typename A>
inline A bessel_factor(int64_t M) {
  return static_cast<A>(static_cast<double>(M) / static_cast<double>(M - 1));
}

// Where the finalize writes (each pointer may be null): the batch's mean, biased var,
// unbiased var (var * bessel, as eager's CUDA update forms it) and invstd, and the
// running statistics (dtype S) it updates in place.
template <typename A, typename S>
struct StatsOut {
  A *mean, *var, *unbiased, *invstd;
  S *running_mean, *running_var;
  A eps, bessel, momentum;
};

// Channel c's statistics from the splits' (mean, m2) partials, merged in split order.
template <typename A, typename S>
C10_HOST_DEVICE inline void finalize_stats_channel(
    const A* partial, const Splits& sp, int64_t C, int64_t c, const StatsOut<A, S>& o) {
  Welford<A> w;
  for (int64_t s = 0; s < sp.count; ++s) {
    Welford<A> part;
    part.mean = partial[Splits::at(s, 0, C, c)];
    part.m2 = partial[Splits::at(s, 1, C, c)];
    part.n = sp.size(s);
    w.merge(part);
  }
  const A var = w.m2 / static_cast<A>(sp.M);
  const A unbiased = var * o.bessel;
  if (o.mean != nullptr) o.mean[c] = w.mean;
  if (o.var != nullptr) o.var[c] = var;
  if (o.unbiased != nullptr) o.unbiased[c] = unbiased;
  if (o.invstd != nullptr) o.invstd[c] = invstd_of(var, o.eps);
  if (o.running_mean != nullptr) {
    o.running_mean[c] = running_update<S, A>(o.running_mean[c], w.mean, o.momentum);
  }
  if (o.running_var != nullptr) {
    o.running_var[c] = running_update<S, A>(o.running_var[c], unbiased, o.momentum);
  }
}

// ---- backward ----

// Where the backward finalize writes (each may be null): grad_weight = sum(g * xhat),
// grad_bias = sum(g), and k = [sum(g) / M ; sum(g * xhat) / M] (2 x C) for grad_input.
template <typename A>
struct BackwardOut {
  A *grad_weight, *grad_bias, *k;
};

// Channel c's results from the splits' (sum(g), sum(g * (x - mean))) partials, summed in
// split order.
template <typename A>
C10_HOST_DEVICE inline void finalize_backward_channel(
    const A* partial, const Splits& sp, int64_t C, int64_t c, const ChannelParams<A>& p,
    const BackwardOut<A>& o) {
  A sum_g = A(0), sum_gxm = A(0);
  for (int64_t s = 0; s < sp.count; ++s) {
    sum_g += partial[Splits::at(s, 0, C, c)];
    sum_gxm += partial[Splits::at(s, 1, C, c)];
  }
  const A sum_gx = sum_gxm * channel_coef(p, c).invstd;
  if (o.grad_weight != nullptr) o.grad_weight[c] = sum_gx;
  if (o.grad_bias != nullptr) o.grad_bias[c] = sum_g;
  if (o.k != nullptr) {
    o.k[c] = sum_g / static_cast<A>(sp.M);
    o.k[C + c] = sum_gx / static_cast<A>(sp.M);
  }
}

// ---- the elementwise kernels' walk ----

// How an elementwise kernel walks the tensor: units of V = 16 / sizeof(T) elements loaded
// and stored as one 16-byte vector, or single elements.
//  * Plane: NCHW with H * W a multiple of V: a unit lies in one channel.
//  * Pixel: channels_last with C a multiple of V: a unit is V consecutive channels.
//  * Scalar: every other case (a pointer not 16-byte aligned, other sizes), one element.
enum class Walk { Scalar, Plane, Pixel };

template <typename T>
constexpr int kVec = sizeof(T) >= 16 ? 1 : static_cast<int>(16 / sizeof(T));

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
inline Walk choose_walk(const Layout& L, const void* a, const void* b, const void* c) {
  constexpr int V = kVec<T>;
  if (V == 1 || !aligned16(a) || !aligned16(b) || !aligned16(c)) return Walk::Scalar;
  if (!L.channels_last && L.HW % V == 0) return Walk::Plane;
  if (L.channels_last && L.C % V == 0) return Walk::Pixel;
  return Walk::Scalar;
}

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// The coefficients of the channels a thread's last unit touched (one channel, or V with
// kPixel), recomputed only when the unit's first channel changes.
template <typename A, int V, bool kPixel, bool kBackward>
struct CoefCache {
  static constexpr int K = kPixel ? V : 1;
  ChannelCoef<A> coef[K] = {};
  A k1[kBackward ? K : 1] = {}, k2[kBackward ? K : 1] = {};
  int64_t first = -1;

  C10_HOST_DEVICE void load(const ChannelParams<A>& p, const A* k, int64_t C, int64_t c0) {
    if (c0 == first) return;
    first = c0;
    FXFUSE_UNROLL
    for (int j = 0; j < K; ++j) {
      coef[j] = channel_coef(p, c0 + j);
      if constexpr (kBackward) {
        k1[j] = k != nullptr ? k[c0 + j] : A(0);
        k2[j] = k != nullptr ? k[C + c0 + j] : A(0);
      }
    }
  }
  C10_HOST_DEVICE int slot(int j) const { return kPixel ? j : 0; }
};

// act(bn(x)) for elements [i, i + V), whose first channel is c0. out may be x.
template <typename T, typename A, int V, bool kPixel>
C10_HOST_DEVICE inline void forward_unit(
    const T* x, T* out, int64_t i, int64_t c0, const ChannelParams<A>& p,
    CoefCache<A, V, kPixel, false>& cache, Act act, A act_param) {
  cache.load(p, nullptr, 0, c0);
  const Pack<T, V> in = *reinterpret_cast<const Pack<T, V>*>(x + i);
  Pack<T, V> res;
  FXFUSE_UNROLL
  for (int j = 0; j < V; ++j) {
    const ChannelCoef<A>& k = cache.coef[cache.slot(j)];
    res.v[j] = forward<T, A>(in.v[j], k.mean, k.scale, k.bias, act, act_param);
  }
  *reinterpret_cast<Pack<T, V>*>(out + i) = res;
}

// Batch norm + activation's grad_input for elements [i, i + V) (first channel c0), from dy
// and x; k: the backward finalize's 2 x C [k1 ; k2] (null without batch statistics). dst
// may be x or dy: the unit reads both before it writes.
template <typename T, typename A, int V, bool kPixel>
C10_HOST_DEVICE inline void grad_input_unit(
    const T* dy, const T* x, T* dst, int64_t i, int64_t c0, const ChannelParams<A>& p,
    const A* k, int64_t C, bool batch_stats, CoefCache<A, V, kPixel, true>& cache, Act act,
    A act_param) {
  cache.load(p, k, C, c0);
  const Pack<T, V> d = *reinterpret_cast<const Pack<T, V>*>(dy + i);
  const Pack<T, V> in = *reinterpret_cast<const Pack<T, V>*>(x + i);
  Pack<T, V> res;
  FXFUSE_UNROLL
  for (int j = 0; j < V; ++j) {
    const int s = cache.slot(j);
    const ChannelCoef<A>& c = cache.coef[s];
    const A g = grad_z<T, A>(d.v[j], in.v[j], c.mean, c.scale, c.bias, act, act_param);
    res.v[j] = grad_input<T, A>(g, in.v[j], c.mean, c.invstd, c.scale, cache.k1[s], cache.k2[s], batch_stats);
  }
  *reinterpret_cast<Pack<T, V>*>(dst + i) = res;
}

}  // namespace fxfuse::elementwise
