// AVX2 + FMA build of the bn_act kernel bodies (bn_act_kernel_impl.h); the scheme is in avx2_begin.h.
#define CPU_CAPABILITY AVX2

#include "bn_act_kernel.h"

#if FXFUSE_HAVE_AVX2_KERNELS
#include "avx2_begin.h"
#include "bn_act_kernel_impl.h"
#include "avx2_end.h"
#endif  // FXFUSE_HAVE_AVX2_KERNELS
