/* internal.h - declarations shared by the C core's source files. Not installed. */
#ifndef AXL_INTERNAL_H
#define AXL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "autoxla.h"

#if defined(__x86_64__) || defined(__i386__)
#define AXL_X86 1
#else
#define AXL_X86 0
#endif

/* CPU features each vectorised ISA needs (axl_cpu_features() bits). */
#define AXL_NEEDS_AVX2 (AXL_CPU_AVX2 | AXL_CPU_F16C | AXL_CPU_FMA)
#define AXL_NEEDS_AVX512 \
    (AXL_NEEDS_AVX2 | AXL_CPU_AVX512F | AXL_CPU_AVX512BW | AXL_CPU_AVX512DQ | AXL_CPU_AVX512VL)

/* Bytes per element of an axl_dtype, 0 for an unknown one. */
static inline size_t axl_dtype_size(int dtype) {
    static const size_t sizes[AXL_DTYPE_COUNT] = {4, 2, 2, 1, 1};
    return dtype >= 0 && dtype < AXL_DTYPE_COUNT ? sizes[dtype] : 0;
}

/* Resolves isa (AUTO included) to one this CPU runs; AXL_ERR_UNSUPPORTED_ISA otherwise. */
int axl_resolve_isa(int isa, int *resolved);

/* ---- dtype conversion kernels --------------------------------------------------------
 * All have the shape of axl_convert_fn: src holds n elements of the first dtype, dst
 * receives n elements of the second; both dense, naturally aligned, not overlapping,
 * n >= 0. Semantics are documented on axl_convert() in autoxla.h; every variant must
 * equal the _ref one bit for bit. */
typedef void (*axl_convert_fn)(const void *src, void *dst, int64_t n);

/* Scalar element conversions, integer-only so the FP environment cannot change them. */
uint32_t axl_f16_to_f32_bits(uint16_t h);
uint16_t axl_f32_bits_to_f16(uint32_t x);
uint16_t axl_f32_bits_to_bf16(uint32_t x);

#define AXL_DECLARE_CONVERT(suffix)                                              \
    void axl_convert_f32_bf16_##suffix(const void *src, void *dst, int64_t n);  \
    void axl_convert_f32_f16_##suffix(const void *src, void *dst, int64_t n);   \
    void axl_convert_bf16_f32_##suffix(const void *src, void *dst, int64_t n);  \
    void axl_convert_bf16_f16_##suffix(const void *src, void *dst, int64_t n);  \
    void axl_convert_f16_f32_##suffix(const void *src, void *dst, int64_t n);   \
    void axl_convert_f16_bf16_##suffix(const void *src, void *dst, int64_t n);

AXL_DECLARE_CONVERT(ref)
#if AXL_X86
AXL_DECLARE_CONVERT(avx2)
AXL_DECLARE_CONVERT(avx512)
#endif

/* The kernel converting src_dtype to dst_dtype with a resolved isa (not AUTO; see
 * axl_resolve_isa), or NULL when the dtypes are equal and the conversion is a plain copy.
 * Both dtypes must be F32, BF16 or F16. What axl_convert runs, for the other entry points
 * that convert (shards.c). */
axl_convert_fn axl_convert_kernel(int isa, int src_dtype, int dst_dtype);

#endif /* AXL_INTERNAL_H */
