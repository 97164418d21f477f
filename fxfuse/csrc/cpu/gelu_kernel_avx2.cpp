// AVX2 + FMA build of the gelu / gelu_backward kernel bodies (gelu_kernel_impl.h).
//
// Same scheme as bn_act_kernel_avx2.cpp (see there for the reasoning): the rest
// of the extension is compiled for the baseline ISA; only the code below the
// target pragma may use AVX2, and it only runs once gelu_kernel.cpp has checked
// that the CPU supports AVX2 and FMA. Every header that is not ATen's vector
// library is included first, for the baseline ISA; after the pragma come only
// at::vec (namespace at::vec::AVX2 once CPU_CAPABILITY is AVX2) and our kernels
// (namespace fxfuse::cpu::AVX2).

// CPU_CAPABILITY only names namespaces; define it before any include so that
// headers which use it put their code in a namespace of their own.
#define CPU_CAPABILITY AVX2

#include "gelu_kernel.h"

#if FXFUSE_HAVE_AVX2_KERNELS

// ---- baseline ISA: everything at::vec needs besides itself ----
#include <ATen/ATen.h>
#include <ATen/NumericUtils.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <ATen/native/quantized/AffineQuantizerBase.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/Load.h>
#include <c10/util/TypeCast.h>
#include <c10/util/complex.h>
#include <c10/util/copysign.h>
#include <c10/util/irange.h>
#include <c10/util/qint32.h>
#include <c10/util/qint8.h>
#include <c10/util/quint8.h>

#include <algorithm>
#include <array>
#include <cassert>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <ostream>
#include <type_traits>
#include <vector>

#include <immintrin.h>

// ---- AVX2 + FMA from here on ----
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#define CPU_CAPABILITY_AVX2

// GCC's C++ front end does not define __AVX__/__AVX2__ for a target pragma, and
// sleef.h declares its 256-bit functions (used by at::vec's AVX2 exp, tanh, ...)
// only under __AVX__: define it for that one header.
#if !defined(__AVX__)
#define __AVX__ 1
#define FXFUSE_DEFINED_AVX_MACRO
#endif
#include <sleef.h>
#if defined(FXFUSE_DEFINED_AVX_MACRO)
#undef __AVX__
#undef FXFUSE_DEFINED_AVX_MACRO
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "gelu_kernel_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // FXFUSE_HAVE_AVX2_KERNELS
