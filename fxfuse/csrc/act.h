// The activations the fused ops apply, by name in the op schemas: "none", "relu",
// "relu6", "leaky_relu", "gelu", "gelu_tanh", "silu", "hardswish". Dependency-free,
// so that device code (cuda/*.cu) can include it.
#pragma once

namespace fxfuse {

enum class Act : int {
  None = 0,
  ReLU,
  ReLU6,
  LeakyReLU,  // act_param = negative_slope
  GELU,       // erf form
  GELUTanh,   // tanh approximation
  SiLU,
  Hardswish,
};

}  // namespace fxfuse
