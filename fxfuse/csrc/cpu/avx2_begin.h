// Opens the AVX2 + FMA part of a kernel translation unit (cpu/*_avx2.cpp); avx2_end.h closes it.
//
// The rest of the extension is compiled for the baseline ISA, so that it loads on any
// x86-64 CPU; only the code between these two headers may use AVX2, and it only runs
// once cpu::use_avx2_kernels() (capability.h) has checked the CPU.
//
// One-definition-rule hygiene: an inline function defined after the target pragma would
// be compiled for AVX2, and if the same function were also emitted by a baseline
// translation unit the linker could keep the AVX2 copy for everyone. So every header
// that is not ATen's vector library is included here first, for the baseline ISA; after
// the pragma come only at::vec (whose code lives in at::vec::AVX2 once CPU_CAPABILITY is
// AVX2) and the kernels (namespace fxfuse::cpu::AVX2).
//
// The including file defines CPU_CAPABILITY AVX2 before any include, so that headers which
// use it put their code in a namespace of their own. No include guard: once per file.

// ---- baseline ISA: everything at::vec needs besides itself ----
#include <ATen/core/Tensor.h>
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
#include <x86intrin.h>

// ---- AVX2 + FMA from here on ----
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#define CPU_CAPABILITY_AVX2

// GCC compiles the function-pointer thunks of lambdas in at::vec's bfloat16/half code for
// the baseline ISA and warns that they pass __m256 by value; they are never used here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

// GCC's C++ front end does not define __AVX__/__AVX2__ for a target pragma, and sleef.h
// declares its 256-bit functions (used by at::vec's AVX2 exp, tanh, ...) only under
// __AVX__: define it for that one header.
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
