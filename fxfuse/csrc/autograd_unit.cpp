// autograd/*.cpp and autocast/*.cpp as one translation unit (setup.py compiles this file, not
// those), for the reason of generic_unit.cpp: their torch headers (custom_function.h,
// autocast_mode.h) and registration templates dominate each one's compile time. Compiled at -O2
// with generic_unit.cpp (setup.py GLUE_UNITS). setup.py fails if a file is in no unit.
#include "autograd/act_linear.cpp"
#include "autograd/act_linear_scale.cpp"
#include "autograd/batch_norm_act.cpp"
#include "autograd/bn_act_conv.cpp"
#include "autograd/conv2d.cpp"
#include "autograd/conv_act.cpp"
#include "autograd/conv_bn_act.cpp"
#include "autograd/gelu.cpp"
#include "autograd/layer_norm_linear.cpp"
#include "autograd/linear_act.cpp"
#include "autograd/pooling.cpp"
#include "autocast/layer_autocast.cpp"
