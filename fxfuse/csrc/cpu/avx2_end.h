// Closes the AVX2 + FMA part opened by avx2_begin.h. No include guard: once per file.
#pragma GCC diagnostic pop

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
