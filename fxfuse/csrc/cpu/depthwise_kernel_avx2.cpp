// AVX2 + FMA build of the depthwise-convolution weight-gradient kernel
// (depthwise_kernel_impl.h); the scheme is in avx2_begin.h.
#define CPU_CAPABILITY AVX2

#include "depthwise_kernel.h"

#if FXFUSE_HAVE_AVX2_KERNELS
#include "avx2_begin.h"
#include "depthwise_kernel_impl.h"
#include "avx2_end.h"
#endif  // FXFUSE_HAVE_AVX2_KERNELS
