// The AVX2 builds of the CPU kernels (cpu/*_avx2.cpp) as one translation unit (setup.py compiles
// this file, not those): each opens and closes its own AVX2 part (cpu/avx2_begin.h, avx2_end.h),
// so that what lies between two of them stays baseline ISA. setup.py fails if one is missing.
#include "cpu/bn_act_kernel_avx2.cpp"
#include "cpu/depthwise_kernel_avx2.cpp"
#include "cpu/gelu_kernel_avx2.cpp"
