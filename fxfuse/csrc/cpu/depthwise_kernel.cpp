// DEFAULT-capability build of the depthwise-convolution weight-gradient kernel
// (depthwise_kernel_impl.h); depthwise_kernel_avx2.cpp holds the AVX2 build, and
// conv2d_backward.cpp the operator entry point that routes to them.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT

#include "depthwise_kernel.h"
#include "depthwise_kernel_impl.h"
