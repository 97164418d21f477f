// The Autograd kernels of the ops outside the BatchNorm family, as one translation unit (the
// reason of generic_unit.cpp); a second unit beside autograd_unit.cpp so that the two build in
// parallel. setup.py fails if an autograd/*.cpp file is in neither, or in both.
#include "autograd/act_linear.cpp"
#include "autograd/act_linear_scale.cpp"
#include "autograd/conv2d.cpp"
#include "autograd/conv_act.cpp"
#include "autograd/gelu.cpp"
#include "autograd/layer_norm_linear.cpp"
#include "autograd/linear_act.cpp"
#include "autograd/pooling.cpp"
