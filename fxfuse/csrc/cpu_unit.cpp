// The hand-written CPU kernels' DEFAULT-capability files (cpu/*.cpp but *_avx2.cpp) as one
// translation unit (setup.py compiles this file, not those), for the reason of generic_unit.cpp.
// Compiled at -O3 with -ffp-contract=off like every kernel file. setup.py fails if one is missing.
#include "cpu/bn_act_elementwise.cpp"
#include "cpu/bn_act_kernel.cpp"
#include "cpu/capability.cpp"
#include "cpu/conv2d_backward.cpp"
#include "cpu/depthwise_kernel.cpp"
#include "cpu/gelu_kernel.cpp"
