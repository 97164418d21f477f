// Which build of the hand-written CPU kernels runs: the baseline one or the AVX2 + FMA one
// (cpu/*_avx2.cpp, compiled with a target pragma; see avx2_begin.h).
#pragma once

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(FXFUSE_NO_AVX2_KERNELS)
#define FXFUSE_HAVE_AVX2_KERNELS 1
#else
#define FXFUSE_HAVE_AVX2_KERNELS 0
#endif

namespace fxfuse::cpu {

// Whether to run the AVX2 build: the CPU must have AVX2 and FMA, and ATen's own CPU
// capability must be AVX2 or better (ATEN_CPU_CAPABILITY=default lowers it, which
// selects the baseline build here too, so fxfuse follows the kernels ATen picks).
bool use_avx2_kernels();

}  // namespace fxfuse::cpu
