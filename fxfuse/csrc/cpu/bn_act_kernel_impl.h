// Vectorized, multi-threaded CPU kernel bodies for bn_act / bn_act_backward.
// Compiled once per CPU capability: include this header from
// exactly one translation unit per capability, with CPU_CAPABILITY defined to
// that capability's name (DEFAULT or AVX2) and, for AVX2, CPU_CAPABILITY_AVX2
// and a matching target ISA. Everything is placed in namespace
// fxfuse::cpu::CPU_CAPABILITY (helpers in an anonymous namespace inside it), so
// the two builds never share a symbol.
//
// Layouts (see Geometry):
//  * NCHW: each (n, c) plane is HW contiguous elements; the per-channel scalars
//    are broadcast and the loops vectorize along HW. Reductions are threaded
//    over channels, elementwise passes over planes.
//  * NHWC: N*HW rows of C contiguous elements; the loops vectorize along C with
//    per-channel coefficient vectors. To keep small C vectorized, a "segment" of
//    R whole rows (R*C >= kTileElems) is processed as one flat run against
//    coefficient arrays tiled R times. Reductions give each thread a chunk of
//    rows and its own (tiled) double accumulators, folded together at the end
//    in a fixed order (deterministic results).
// Remainders use partial (masked) vector loads/stores, with the unused lanes
// blended to zero before they reach an accumulator.
//
// Passes over memory: bn_act 1, bn_act_backward 2 (per-channel sums, then grad_input);
// g = dy * act'(z) is recomputed in each backward pass from dy and x, never stored.
//
// Exactness: z = x * alpha + beta rounds as ATen's batch_norm kernel of the same
// capability (bn_z), so with eager's statistics (bn_stats, bn_act_kernel.cpp) the float32
// training forward is eager's bit for bit. The backward recomputes that same z; its sums
// run in T over short blocks (32 vectors per lane) whose partial sums are added up in
// double.
#pragma once

#ifndef CPU_CAPABILITY
#error "bn_act_kernel_impl.h must be included with CPU_CAPABILITY defined"
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "activation.h"
#include "bn_act_kernel.h"

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace fxfuse::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using DVec = Vectorized<double>;

// Elements per parallel task below which work is not split (ATen's GRAIN_SIZE).
constexpr int64_t kGrain = 32768;
// Minimum length of a flat NHWC segment (whole rows) processed in one run.
constexpr int64_t kTileElems = 256;

inline int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Number of DVec needed to hold one Vectorized<T> widened to double.
template <typename T>
constexpr int kWide = static_cast<int>(Vectorized<T>::size() / DVec::size());

static_assert(kWide<double> == 1, "unexpected Vectorized<double> width");
static_assert(kWide<float> == 2, "unexpected Vectorized<float> width");

inline void widen(const Vectorized<double>& v, DVec* out) { out[0] = v; }

inline void widen(const Vectorized<float>& v, DVec* out) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 f = v;
  out[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
  out[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
#else
  __at_align__ float f[Vectorized<float>::size()];
  __at_align__ double d[Vectorized<float>::size()];
  v.store(f);
  for (int64_t i = 0; i < Vectorized<float>::size(); ++i) d[i] = static_cast<double>(f[i]);
  out[0] = DVec::loadu(d);
  out[1] = DVec::loadu(d + DVec::size());
#endif
}

inline double hsum(const DVec& v) {
  __at_align__ double d[DVec::size()];
  v.store(d);
  double s = 0;
  for (int64_t i = 0; i < DVec::size(); ++i) s += d[i];
  return s;
}

// Accumulator for a stream of Vectorized<T>, summed in double. Float input is
// first summed in a float vector over short blocks (kFlush vectors per lane),
// which keeps the hot loop to one add and a few registers; the blocks are added
// up in double.
template <typename T>
struct DAcc {
  DVec a = DVec(0.0);
  void add(const Vectorized<T>& v) { a = a + v; }
  double sum() const { return hsum(a); }
};

template <>
struct DAcc<float> {
  static constexpr int kFlush = 32;
  DVec a[2] = {DVec(0.0), DVec(0.0)};
  Vectorized<float> f = Vectorized<float>(0.0f);
  int n = 0;
  void add(const Vectorized<float>& v) {
    f = f + v;
    if (++n == kFlush) flush();
  }
  void flush() {
    DVec w[2];
    widen(f, w);
    a[0] = a[0] + w[0];
    a[1] = a[1] + w[1];
    f = Vectorized<float>(0.0f);
    n = 0;
  }
  double sum() {
    flush();
    return hsum(a[0] + a[1]);
  }
};

// Rounding barrier: g = rounded(dy * act'(z)) is bitwise the same in both backward
// passes, so g - sum_g / M is exactly 0 where it should be (e.g. a single element per
// channel). The AVX2 build could otherwise fuse the multiply with a later add or subtract
// (setup.py passes -ffp-contract=off, but the kernels do not rely on it); the baseline
// x86-64 build has no FMA to fuse into.
inline Vectorized<float> rounded(const Vectorized<float>& v) {
#if defined(CPU_CAPABILITY_AVX2) && defined(__GNUC__)
  __m256 r = v;
  __asm__("" : "+x"(r));
  return r;
#else
  return v;
#endif
}

inline Vectorized<double> rounded(const Vectorized<double>& v) {
#if defined(CPU_CAPABILITY_AVX2) && defined(__GNUC__)
  __m256d r = v;
  __asm__("" : "+x"(r));
  return r;
#else
  return v;
#endif
}

template <typename T>
inline Vectorized<T> mul_rounded(const Vectorized<T>& a, const Vectorized<T>& b) {
  return rounded(a * b);
}

// The batch-norm pre-activation z = x * alpha + beta (alpha = invstd * weight,
// beta = bias - mean * alpha), rounded as ATen's batch_norm kernel of the same CPU
// capability rounds it, so that z, and with it every activation branch (relu's z > 0,
// hardswish's +-3, ...), is eager's bit for bit: ATen's AVX2 and AVX-512 builds are
// compiled with FMA contraction (one rounding), its baseline build has no FMA (two).
template <typename T>
inline Vectorized<T> bn_z(const Vectorized<T>& x, const Vectorized<T>& alpha, const Vectorized<T>& beta) {
  return madd(x, alpha, beta);
}

// beta = bias - mean * alpha, rounded as ATen's scalar code of the same capability does.
template <typename T>
void shift_kernel(int64_t C, const T* mean, const T* alpha, const T* bias, T* beta) {
  for (int64_t c = 0; c < C; ++c) {
    const T b = bias ? bias[c] : T(0);
#if defined(CPU_CAPABILITY_AVX2)
    beta[c] = std::fma(-mean[c], alpha[c], b);
#else
    beta[c] = b - mean[c] * alpha[c];
#endif
  }
}

// ----------------------------------------------------------------------------
// Row segmentation for NHWC: R rows per segment and tiled per-channel arrays.

inline int64_t tile_rows(int64_t C) { return std::max<int64_t>(1, divup(kTileElems, C)); }

template <typename T>
std::vector<T> tiled(const T* v, int64_t C, int64_t R) {
  std::vector<T> t;  // filled by appending: a sized vector would be zeroed first, then overwritten
  t.reserve(static_cast<size_t>(R * C));
  for (int64_t r = 0; r < R; ++r) t.insert(t.end(), v, v + C);
  return t;
}

// Splits `rows` rows into at most num_threads chunks of at least ~kGrain
// elements; calls f(chunk, row_begin, row_end) in parallel.
template <typename F>
int64_t for_row_chunks(int64_t rows, int64_t C, const F& f) {
  const int64_t total = rows * C;
  const int64_t nchunks = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), total / kGrain));
  const int64_t per = divup(rows, nchunks);
  at::parallel_for(0, nchunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t ch = b; ch < e; ++ch) {
      const int64_t r0 = ch * per;
      const int64_t r1 = std::min(rows, r0 + per);
      if (r0 < r1) f(ch, r0, r1);
    }
  });
  return nchunks;
}

// ----------------------------------------------------------------------------
// bn_act forward

template <Act A, typename T>
void forward_impl(const Geometry& g, const T* x, const Coeffs<T>& cf, T param, T* out) {
  using Vec = Vectorized<T>;
  using Op = ActOp<A, T>;
  constexpr int64_t VS = Vec::size();
  if (!g.nhwc) {
    const int64_t C = g.C, HW = g.HW;
    at::parallel_for(0, g.N * C, std::max<int64_t>(1, kGrain / HW), [&](int64_t b, int64_t e) {
      for (int64_t pl = b; pl < e; ++pl) {
        const int64_t c = pl % C;
        const Vec al(cf.alpha[c]), be(cf.beta[c]);
        const T* p = x + pl * HW;
        T* o = out + pl * HW;
        int64_t i = 0;
        for (; i + VS <= HW; i += VS) {
          Op::fwd(bn_z(Vec::loadu(p + i), al, be), param).store(o + i);
        }
        if (i < HW) {
          const int64_t r = HW - i;
          Op::fwd(bn_z(Vec::loadu(p + i, r), al, be), param).store(o + i, r);
        }
      }
    });
  } else {
    const int64_t C = g.C, rows = g.N * g.HW;
    const int64_t R = tile_rows(C);
    const std::vector<T> alt = tiled(cf.alpha, C, R), bet = tiled(cf.beta, C, R);
    const int64_t nseg = divup(rows, R);
    at::parallel_for(0, nseg, std::max<int64_t>(1, kGrain / (R * C)), [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s) {
        const int64_t r = s * R;
        const int64_t len = std::min(R, rows - r) * C;
        const T* p = x + r * C;
        T* o = out + r * C;
        int64_t j = 0;
        for (; j + VS <= len; j += VS) {
          Op::fwd(bn_z(Vec::loadu(p + j), Vec::loadu(alt.data() + j), Vec::loadu(bet.data() + j)), param)
              .store(o + j);
        }
        if (j < len) {
          const int64_t n = len - j;
          const Vec z = bn_z(Vec::loadu(p + j, n), Vec::loadu(alt.data() + j, n), Vec::loadu(bet.data() + j, n));
          Op::fwd(z, param).store(o + j, n);
        }
      }
    });
  }
}

// ----------------------------------------------------------------------------
// bn_act_backward, pass 1: per-channel sums of g and g * (x - mean)

template <Act A, typename T>
void backward_reduce_impl(
    const Geometry& g, const T* dy, const T* x, const Coeffs<T>& cf, T param, double* sum_g,
    double* sum_gxm, T* g_out) {
  using Vec = Vectorized<T>;
  using Op = ActOp<A, T>;
  constexpr int64_t VS = Vec::size();
  const Vec zero(T(0));
  if (!g.nhwc) {
    const int64_t N = g.N, C = g.C, HW = g.HW;
    at::parallel_for(0, C, std::max<int64_t>(1, kGrain / (N * HW)), [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        const Vec mu(cf.mean[c]), al(cf.alpha[c]), be(cf.beta[c]);
        DAcc<T> ag, agx;
        for (int64_t n = 0; n < N; ++n) {
          const T* p = x + (n * C + c) * HW;
          const T* q = dy + (n * C + c) * HW;
          int64_t i = 0;
          for (; i + VS <= HW; i += VS) {
            const Vec xv = Vec::loadu(p + i);
            const Vec xm = xv - mu;
            const Vec gv = rounded(Op::bwd(Vec::loadu(q + i), bn_z(xv, al, be), param));
            if (g_out) gv.store(g_out + (q - dy) + i);
            ag.add(gv);
            agx.add(gv * xm);
          }
          if (i < HW) {
            const int64_t r = HW - i;
            const Vec xv = Vec::loadu(p + i, r);
            const Vec xm = xv - mu;
            const Vec gv = rounded(Op::bwd(Vec::loadu(q + i, r), bn_z(xv, al, be), param));
            if (g_out) gv.store(g_out + (q - dy) + i, r);
            // lanes past the end must not reach the sums
            ag.add(Vec::set(zero, gv, r));
            agx.add(Vec::set(zero, gv * xm, r));
          }
        }
        sum_g[c] = ag.sum();
        sum_gxm[c] = agx.sum();
      }
    });
  } else {
    const int64_t C = g.C, rows = g.N * g.HW;
    const int64_t R = tile_rows(C), L = R * C;
    const std::vector<T> mut = tiled(cf.mean, C, R), alt = tiled(cf.alpha, C, R),
                         bet = tiled(cf.beta, C, R);
    const int64_t max_chunks = std::max<int64_t>(1, at::get_num_threads());
    std::vector<double> buf(static_cast<size_t>(max_chunks * 2 * L), 0.0);
    const int64_t nchunks = for_row_chunks(rows, C, [&](int64_t ch, int64_t r0, int64_t r1) {
      // Per-segment sums go to T staging arrays, flushed into the chunk's double
      // accumulators every kFlushSegments segments (cf. DAcc).
      constexpr int kFlushSegments = 32;
      double* acc = buf.data() + ch * 2 * L;
      std::vector<T> stage(static_cast<size_t>(2 * L + VS), T(0));
      T* ag = stage.data();
      T* agx = ag + L;
      int pending = 0;
      auto flush = [&] {
        for (int64_t k = 0; k < 2 * L; ++k) {
          acc[k] += static_cast<double>(stage[k]);
          stage[k] = T(0);
        }
        pending = 0;
      };
      for (int64_t r = r0; r < r1; r += R) {
        const int64_t len = std::min(R, r1 - r) * C;
        const T* p = x + r * C;
        const T* q = dy + r * C;
        int64_t j = 0;
        for (; j + VS <= len; j += VS) {
          const Vec xv = Vec::loadu(p + j);
          const Vec xm = xv - Vec::loadu(mut.data() + j);
          const Vec z = bn_z(xv, Vec::loadu(alt.data() + j), Vec::loadu(bet.data() + j));
          const Vec gv = rounded(Op::bwd(Vec::loadu(q + j), z, param));
          if (g_out) gv.store(g_out + (q - dy) + j);
          (Vec::loadu(ag + j) + gv).store(ag + j);
          (Vec::loadu(agx + j) + gv * xm).store(agx + j);
        }
        if (j < len) {
          // The last vector may reach past the L accumulator slots: add lane by lane.
          const int64_t n = len - j;
          const Vec xv = Vec::loadu(p + j, n);
          const Vec xm = xv - Vec::loadu(mut.data() + j, n);
          const Vec z = bn_z(xv, Vec::loadu(alt.data() + j, n), Vec::loadu(bet.data() + j, n));
          const Vec gv = rounded(Op::bwd(Vec::loadu(q + j, n), z, param));
          if (g_out) gv.store(g_out + (q - dy) + j, n);
          __at_align__ T gb[VS], gxb[VS];
          gv.store(gb);
          (gv * xm).store(gxb);
          for (int64_t k = 0; k < n; ++k) {
            ag[j + k] += gb[k];
            agx[j + k] += gxb[k];
          }
        }
        if (++pending == kFlushSegments) flush();
      }
      flush();
    });
    TORCH_INTERNAL_ASSERT(nchunks <= max_chunks);
    for (int64_t c = 0; c < C; ++c) {
      double sg = 0, sgx = 0;
      for (int64_t ch = 0; ch < nchunks; ++ch) {
        const double* b = buf.data() + ch * 2 * L;
        for (int64_t r = 0; r < R; ++r) {
          sg += b[r * C + c];
          sgx += b[L + r * C + c];
        }
      }
      sum_g[c] = sg;
      sum_gxm[c] = sgx;
    }
  }
}

// ----------------------------------------------------------------------------
// bn_act_backward, pass 2: grad_input

template <typename T>
struct ChannelVecs {
  Vectorized<T> mu, al, be, is, k1, k2;
};

template <Act A, bool kBatchStats, typename T>
inline Vectorized<T> grad_input_vec(
    const Vectorized<T>& dyv, const Vectorized<T>& xv, const ChannelVecs<T>& v, T param) {
  const Vectorized<T> gv = rounded(ActOp<A, T>::bwd(dyv, bn_z(xv, v.al, v.be), param));
  if constexpr (kBatchStats) {
    return ((gv - v.k1) - ((xv - v.mu) * v.is) * v.k2) * v.al;
  } else {
    return gv * v.al;
  }
}

template <Act A, bool kBatchStats, typename T>
void backward_input_impl(
    const Geometry& g, const T* dy, const T* x, const Coeffs<T>& cf, T param, T* gi) {
  using Vec = Vectorized<T>;
  constexpr int64_t VS = Vec::size();
  if (!g.nhwc) {
    const int64_t C = g.C, HW = g.HW;
    at::parallel_for(0, g.N * C, std::max<int64_t>(1, kGrain / HW), [&](int64_t b, int64_t e) {
      for (int64_t pl = b; pl < e; ++pl) {
        const int64_t c = pl % C;
        ChannelVecs<T> v{Vec(cf.mean[c]), Vec(cf.alpha[c]), Vec(cf.beta[c]), Vec(T(0)), Vec(T(0)), Vec(T(0))};
        if (kBatchStats) {
          v.is = Vec(cf.invstd[c]);
          v.k1 = Vec(cf.k1[c]);
          v.k2 = Vec(cf.k2[c]);
        }
        const T* p = x + pl * HW;
        const T* q = dy + pl * HW;
        T* o = gi + pl * HW;
        int64_t i = 0;
        for (; i + VS <= HW; i += VS) {
          grad_input_vec<A, kBatchStats>(Vec::loadu(q + i), Vec::loadu(p + i), v, param).store(o + i);
        }
        if (i < HW) {
          const int64_t r = HW - i;
          grad_input_vec<A, kBatchStats>(Vec::loadu(q + i, r), Vec::loadu(p + i, r), v, param)
              .store(o + i, r);
        }
      }
    });
  } else {
    const int64_t C = g.C, rows = g.N * g.HW;
    const int64_t R = tile_rows(C);
    const std::vector<T> mut = tiled(cf.mean, C, R), alt = tiled(cf.alpha, C, R),
                         bet = tiled(cf.beta, C, R);
    std::vector<T> ist, k1t, k2t;
    if (kBatchStats) {
      ist = tiled(cf.invstd, C, R);
      k1t = tiled(cf.k1, C, R);
      k2t = tiled(cf.k2, C, R);
    }
    const int64_t nseg = divup(rows, R);
    at::parallel_for(0, nseg, std::max<int64_t>(1, kGrain / (R * C)), [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s) {
        const int64_t r = s * R;
        const int64_t len = std::min(R, rows - r) * C;
        const T* p = x + r * C;
        const T* q = dy + r * C;
        T* o = gi + r * C;
        for (int64_t j = 0; j < len; j += VS) {
          const int64_t n = std::min<int64_t>(VS, len - j);
          ChannelVecs<T> v{
              Vec::loadu(mut.data() + j, n), Vec::loadu(alt.data() + j, n),
              Vec::loadu(bet.data() + j, n), Vec(T(0)), Vec(T(0)), Vec(T(0))};
          if (kBatchStats) {
            v.is = Vec::loadu(ist.data() + j, n);
            v.k1 = Vec::loadu(k1t.data() + j, n);
            v.k2 = Vec::loadu(k2t.data() + j, n);
          }
          grad_input_vec<A, kBatchStats>(Vec::loadu(q + j, n), Vec::loadu(p + j, n), v, param)
              .store(o + j, n);
        }
      }
    });
  }
}

// ----------------------------------------------------------------------------
// Activation dispatch

template <typename T, typename F>
void with_act(Act act, const F& f) {
  switch (act) {
    case Act::None: return f(std::integral_constant<Act, Act::None>{});
    case Act::ReLU: return f(std::integral_constant<Act, Act::ReLU>{});
    case Act::ReLU6: return f(std::integral_constant<Act, Act::ReLU6>{});
    case Act::LeakyReLU: return f(std::integral_constant<Act, Act::LeakyReLU>{});
    case Act::GELU: return f(std::integral_constant<Act, Act::GELU>{});
    case Act::GELUTanh: return f(std::integral_constant<Act, Act::GELUTanh>{});
    case Act::SiLU: return f(std::integral_constant<Act, Act::SiLU>{});
    case Act::Hardswish: return f(std::integral_constant<Act, Act::Hardswish>{});
  }
  TORCH_INTERNAL_ASSERT(false, "fxfuse: unhandled activation");
}

template <typename T>
void forward_kernel(const Geometry& g, const T* x, const Coeffs<T>& cf, Act act, T param, T* out) {
  with_act<T>(act, [&](auto a) { forward_impl<decltype(a)::value>(g, x, cf, param, out); });
}

template <typename T>
void backward_reduce_kernel(
    const Geometry& g, const T* dy, const T* x, const Coeffs<T>& cf, Act act, T param,
    double* sum_g, double* sum_gxm, T* g_out) {
  with_act<T>(act, [&](auto a) {
    backward_reduce_impl<decltype(a)::value>(g, dy, x, cf, param, sum_g, sum_gxm, g_out);
  });
}

template <typename T>
void backward_input_kernel(
    const Geometry& g, const T* dy, const T* x, const Coeffs<T>& cf, bool batch_stats, Act act,
    T param, T* gi) {
  with_act<T>(act, [&](auto a) {
    if (batch_stats) {
      backward_input_impl<decltype(a)::value, true>(g, dy, x, cf, param, gi);
    } else {
      backward_input_impl<decltype(a)::value, false>(g, dy, x, cf, param, gi);
    }
  });
}

}  // namespace

template <typename T>
const KernelTable<T>& kernels() {
  static const KernelTable<T> table{
      &shift_kernel<T>, &forward_kernel<T>, &backward_reduce_kernel<T>, &backward_input_kernel<T>};
  return table;
}

template const KernelTable<float>& kernels<float>();
template const KernelTable<double>& kernels<double>();

}  // namespace fxfuse::cpu::CPU_CAPABILITY
