// The process-wide switch that sends CPU tensors to the device-generic implementations
// (generic/*.cpp, what CUDA and every other device run) instead of the hand-written CPU
// kernels, so that tests and benchmarks can run and measure the generic path on CPU end
// to end. Off by default; FXFUSE_GENERIC=1 at load turns it on, and
// torch.ops.fxfuse_generic.set_enabled (fxfuse.ops.generic_path()) sets it.
#pragma once

namespace fxfuse {

bool generic_path();

// Sets the switch; returns its previous value.
bool set_generic_path(bool enabled);

}  // namespace fxfuse
