// autograd/*.cpp and autocast/*.cpp as one translation unit (setup.py compiles this file, not
// those), for the reason of generic_unit.cpp: their torch headers (custom_function.h,
// autocast_mode.h) dominate each one's compile time. setup.py fails if one is missing here.
#include "autograd/batch_norm_act.cpp"
#include "autograd/bn_act_conv.cpp"
#include "autograd/conv_bn_act.cpp"
#include "autocast/layer_autocast.cpp"
