#include "capability.h"

#include <string>

#include <ATen/Version.h>

namespace fxfuse::cpu {

bool use_avx2_kernels() {
#if FXFUSE_HAVE_AVX2_KERNELS
  static const bool ok = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return false;
    const std::string aten = at::get_cpu_capability();  // "NO AVX", "AVX2", "AVX512", ...
    return aten == "AVX2" || aten == "AVX512";
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace fxfuse::cpu
