// Which build of the hand-written CPU kernels runs: the baseline one or the AVX2 + FMA one
// (cpu/*_avx2.cpp, compiled with a target pragma; see avx2_begin.h).
#pragma once

#include <cstdint>
#include <string>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(FXFUSE_NO_AVX2_KERNELS)
#define FXFUSE_HAVE_AVX2_KERNELS 1
#else
#define FXFUSE_HAVE_AVX2_KERNELS 0
#endif

namespace fxfuse::cpu {

// The CPUID and XCR0 bits that decide whether AVX2 + FMA code can run.
struct CpuId {
  uint32_t leaf1_ecx = 0;  // FMA (bit 12), OSXSAVE (27), AVX (28)
  uint32_t leaf7_ebx = 0;  // AVX2 (bit 5)
  uint64_t xcr0 = 0;       // the register state the OS saves: SSE (bit 1), AVX's YMM (bit 2)
};

// This CPU's bits (all zero off x86-64). XCR0 is read only where CPUID says the OS set
// OSXSAVE (XGETBV itself faults otherwise).
CpuId read_cpu_id();

// Whether the CPU has AVX, AVX2 and FMA and the OS has enabled the YMM state they use:
// CPUID bits alone are not enough (a hypervisor can pass them through to an OS that does
// not save that state, and the instructions then fault). The kernels use nothing wider
// than AVX2, so AVX-512's state does not matter here.
bool avx2_fma_usable(const CpuId& id);

// Whether to run the AVX2 build: avx2_fma_usable on this CPU, and ATen's own CPU
// capability must be AVX2 or better (ATEN_CPU_CAPABILITY=default lowers it, which
// selects the baseline build here too, so fxfuse follows the kernels ATen picks).
bool use_avx2_kernels();

// The build use_avx2_kernels() picks, named like ATen's capabilities: "AVX2" or "DEFAULT".
std::string kernel_build();

}  // namespace fxfuse::cpu
