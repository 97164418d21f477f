// fxfuse._C's direct calls into the ops (direct_calls.cpp), added to the module at its import.
#pragma once

#include <Python.h>

namespace fxfuse {
PyMethodDef* direct_call_methods();
}  // namespace fxfuse
