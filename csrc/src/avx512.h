/* avx512.h - AVX-512 helpers shared by the quantization files (quant_avx512.c,
 * quant_search_avx512.c). Only for x86 builds; every function carries the target attribute. */
#ifndef AXL_AVX512_H
#define AXL_AVX512_H

#include <immintrin.h>

#include "internal.h"

#define AXL_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c,fma")))
#define INLINE static inline __attribute__((always_inline))

#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* Mask of the first n (<= 16) lanes. */
AXL_AVX512 INLINE __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* 16 elements of a src_dtype row from index k widened to f32; lanes outside m read as 0
 * (and their memory is not touched). */
AXL_AVX512 INLINE __m512 load_x(const void *w, int src_dtype, int64_t k, __mmask16 m) {
    if (src_dtype == AXL_F32) return _mm512_maskz_loadu_ps(m, (const float *)w + k);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k);
    if (src_dtype == AXL_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* The scales of 16 blocks as a block uses them (axl_scale_round): each lane of s (finite,
 * >= 0) as it is (AXL_F32), rounded up to bf16 (add 0xFFFF, then drop the low 16 bits), or
 * to fp16 (vcvtps2ph rounding toward +Inf: the smallest fp16 >= s, +Inf above 65504), and
 * widened back. */
AXL_AVX512 INLINE __m512 round_scales(__m512 s, int scale_dtype) {
    if (scale_dtype == AXL_F32) return s;
    if (scale_dtype == AXL_F16)
        return _mm512_cvtph_ps(_mm512_cvt_roundps_ph(s, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
    __m512i b = _mm512_add_epi32(_mm512_castps_si512(s), _mm512_set1_epi32(0xFFFF));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000)));
}

#endif /* AXL_AVX512_H */
