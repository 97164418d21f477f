#include "capability.h"

#include <ATen/Version.h>

#if FXFUSE_HAVE_AVX2_KERNELS
#include <cpuid.h>
#endif

namespace fxfuse::cpu {

CpuId read_cpu_id() {
  CpuId id;
#if FXFUSE_HAVE_AVX2_KERNELS
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d)) id.leaf1_ecx = c;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) id.leaf7_ebx = b;
  if (id.leaf1_ecx & (1u << 27)) {
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    id.xcr0 = (uint64_t(hi) << 32) | lo;
  }
#endif
  return id;
}

bool avx2_fma_usable(const CpuId& id) {
  constexpr uint32_t kFma = 1u << 12, kOsxsave = 1u << 27, kAvx = 1u << 28;
  constexpr uint32_t kAvx2 = 1u << 5;
  constexpr uint64_t kSseYmm = 0x6;
  return (id.leaf1_ecx & (kFma | kOsxsave | kAvx)) == (kFma | kOsxsave | kAvx) && (id.leaf7_ebx & kAvx2) &&
         (id.xcr0 & kSseYmm) == kSseYmm;
}

bool use_avx2_kernels() {
#if FXFUSE_HAVE_AVX2_KERNELS
  static const bool ok = [] {
    if (!avx2_fma_usable(read_cpu_id())) return false;
    const std::string aten = at::get_cpu_capability();  // "NO AVX", "AVX2", "AVX512", ...
    return aten == "AVX2" || aten == "AVX512";
  }();
  return ok;
#else
  return false;
#endif
}

std::string kernel_build() { return use_avx2_kernels() ? "AVX2" : "DEFAULT"; }

}  // namespace fxfuse::cpu
