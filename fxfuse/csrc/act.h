// The activations the fused ops apply, by name in the op schemas. This X-macro table is
// the C++ half of the activation registry; fxfuse/ops/activations.py is the Python half,
// and tests/test_ops_activations.py checks that the two list the same names in the same
// order (fxfuse._C._activations()). Adding an activation is one line here and one entry
// there; the build (-Werror=switch) then names every kernel switch that must handle it.
// Dependency-free, so that device code (cuda/*.cu) can include it.
#pragma once

#define FXFUSE_ACTIVATIONS(X)                                \
  X(None, "none")                                            \
  X(ReLU, "relu")                                            \
  X(ReLU6, "relu6")                                          \
  X(LeakyReLU, "leaky_relu") /* act_param = negative_slope */ \
  X(GELU, "gelu")            /* erf form */                   \
  X(GELUTanh, "gelu_tanh")   /* tanh approximation */         \
  X(SiLU, "silu")                                            \
  X(Hardswish, "hardswish")

namespace fxfuse {

enum class Act : int {
#define FXFUSE_ACT_ENUMERATOR(enumerator, name) enumerator,
  FXFUSE_ACTIVATIONS(FXFUSE_ACT_ENUMERATOR)
#undef FXFUSE_ACT_ENUMERATOR
};

// The schema names, indexed by Act.
inline constexpr const char* kActNames[] = {
#define FXFUSE_ACT_NAME(enumerator, name) name,
    FXFUSE_ACTIVATIONS(FXFUSE_ACT_NAME)
#undef FXFUSE_ACT_NAME
};
inline constexpr int kNumActs = sizeof(kActNames) / sizeof(kActNames[0]);

}  // namespace fxfuse
