// generic/*.cpp, module.cpp and direct_calls.cpp as one translation unit (setup.py compiles this
// file, not those): each of them alone spends most of its compile time in the same torch headers
// and registration templates, so together they build in a fraction of the CPU time. Glue around
// ATen calls, compiled at -O2 (setup.py GLUE_UNITS). setup.py fails if one is missing here.
#include "generic/act_linear.cpp"
#include "generic/act_linear_scale.cpp"
#include "generic/avg_pool2d.cpp"
#include "generic/batch_norm_act.cpp"
#include "generic/bn_act.cpp"
#include "generic/bn_act_conv.cpp"
#include "generic/conv2d.cpp"
#include "generic/conv_act.cpp"
#include "generic/conv_bn_act.cpp"
#include "generic/conv_layer_norm_linear.cpp"
#include "generic/gelu.cpp"
#include "generic/layer_norm_linear.cpp"
#include "generic/linear_act.cpp"
#include "generic/max_pool2d.cpp"
#include "generic/running_stats.cpp"
#include "module.cpp"
#include "direct_calls.cpp"
