// The BatchNorm family's autograd/*.cpp and autocast/*.cpp as one translation unit (setup.py
// compiles this file, not those), for the reason of generic_unit.cpp: their torch headers
// (custom_function.h, autocast_mode.h) dominate each one's compile time. The other ops'
// Autograd kernels are autograd_layers_unit.cpp. setup.py fails if a file is in no unit.
#include "autograd/batch_norm_act.cpp"
#include "autograd/bn_act_conv.cpp"
#include "autograd/conv_bn_act.cpp"
#include "autocast/layer_autocast.cpp"
