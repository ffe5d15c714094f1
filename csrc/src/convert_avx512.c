/* convert_avx512.c - dtype conversions with AVX-512, 32 elements per step, scalar
 * reference for the tail. Compiled for any x86 CPU (per-function target attributes);
 * convert.c only calls these when the CPU has AXL_NEEDS_AVX512. */
#include "internal.h"

#if AXL_X86
#include <immintrin.h>

#define AXL_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c,fma")))

/* f32 bits (16 lanes) -> 16 bf16 bits; see axl_f32_bits_to_bf16. */
AXL_AVX512 static inline __m256i bf16_round(__m512i x) {
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb);
    r = _mm512_srli_epi32(r, 16);
    /* Integer NaN test: FP compares would follow MXCSR.DAZ. */
    __m512i abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF));
    __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7F800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

AXL_AVX512 static inline __m512i load_bf16_as_f32(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}

AXL_AVX512 static inline __m512 load_f16_as_f32(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

AXL_AVX512 static inline void store_f32_as_f16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

AXL_AVX512 void axl_convert_f32_bf16_avx512(const void *src, void *dst, int64_t n) {
    const uint32_t *s = src;
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i a = bf16_round(_mm512_loadu_si512(s + i));
        __m256i b = bf16_round(_mm512_loadu_si512(s + i + 16));
        _mm512_storeu_si512(d + i, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
    axl_convert_f32_bf16_ref(s + i, d + i, n - i);
}

AXL_AVX512 void axl_convert_f32_f16_avx512(const void *src, void *dst, int64_t n) {
    const float *s = src;
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        store_f32_as_f16(d + i, _mm512_loadu_ps(s + i));
        store_f32_as_f16(d + i + 16, _mm512_loadu_ps(s + i + 16));
    }
    axl_convert_f32_f16_ref(s + i, d + i, n - i);
}

AXL_AVX512 void axl_convert_bf16_f32_avx512(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    uint32_t *d = dst;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        _mm512_storeu_si512(d + i, load_bf16_as_f32(s + i));
        _mm512_storeu_si512(d + i + 16, load_bf16_as_f32(s + i + 16));
    }
    axl_convert_bf16_f32_ref(s + i, d + i, n - i);
}

AXL_AVX512 void axl_convert_bf16_f16_avx512(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        store_f32_as_f16(d + i, _mm512_castsi512_ps(load_bf16_as_f32(s + i)));
        store_f32_as_f16(d + i + 16, _mm512_castsi512_ps(load_bf16_as_f32(s + i + 16)));
    }
    axl_convert_bf16_f16_ref(s + i, d + i, n - i);
}

AXL_AVX512 void axl_convert_f16_f32_avx512(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    float *d = dst;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        _mm512_storeu_ps(d + i, load_f16_as_f32(s + i));
        _mm512_storeu_ps(d + i + 16, load_f16_as_f32(s + i + 16));
    }
    axl_convert_f16_f32_ref(s + i, d + i, n - i);
}

AXL_AVX512 void axl_convert_f16_bf16_avx512(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i a = bf16_round(_mm512_castps_si512(load_f16_as_f32(s + i)));
        __m256i b = bf16_round(_mm512_castps_si512(load_f16_as_f32(s + i + 16)));
        _mm512_storeu_si512(d + i, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
    axl_convert_f16_bf16_ref(s + i, d + i, n - i);
}

#endif /* AXL_X86 */
