/* convert_avx2.c - dtype conversions with AVX2 + F16C, 16 elements per step, scalar
 * reference for the tail. Compiled for any x86 CPU (per-function target attributes);
 * convert.c only calls these when the CPU has AXL_NEEDS_AVX2. */
#include "internal.h"

#if AXL_X86
#include <immintrin.h>

#define AXL_AVX2 __attribute__((target("avx2,f16c,fma")))

/* f32 bits (8 lanes) -> bf16 bits in the low half of each lane; see axl_f32_bits_to_bf16. */
AXL_AVX2 static inline __m256i bf16_round(__m256i x) {
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb);
    r = _mm256_srli_epi32(r, 16);
    /* Integer NaN test: FP compares would follow MXCSR.DAZ. */
    __m256i abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

/* Two vectors of 16-bit values held in 32-bit lanes -> 16 packed uint16, in order. */
AXL_AVX2 static inline __m256i pack16(__m256i lo, __m256i hi) {
    /* packus works per 128-bit lane; the permute puts the four quarters back in order. */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), _MM_SHUFFLE(3, 1, 2, 0));
}

AXL_AVX2 static inline __m256i load_bf16_as_f32(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
}

AXL_AVX2 static inline __m128i f32_to_f16(__m256 x) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

AXL_AVX2 void axl_convert_f32_bf16_avx2(const void *src, void *dst, int64_t n) {
    const uint32_t *s = src;
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i a = bf16_round(_mm256_loadu_si256((const __m256i *)(s + i)));
        __m256i b = bf16_round(_mm256_loadu_si256((const __m256i *)(s + i + 8)));
        _mm256_storeu_si256((__m256i *)(d + i), pack16(a, b));
    }
    axl_convert_f32_bf16_ref(s + i, d + i, n - i);
}

AXL_AVX2 void axl_convert_f32_f16_avx2(const void *src, void *dst, int64_t n) {
    const float *s = src;
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm_storeu_si128((__m128i *)(d + i), f32_to_f16(_mm256_loadu_ps(s + i)));
        _mm_storeu_si128((__m128i *)(d + i + 8), f32_to_f16(_mm256_loadu_ps(s + i + 8)));
    }
    axl_convert_f32_f16_ref(s + i, d + i, n - i);
}

AXL_AVX2 void axl_convert_bf16_f32_avx2(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    uint32_t *d = dst;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_si256((__m256i *)(d + i), load_bf16_as_f32(s + i));
        _mm256_storeu_si256((__m256i *)(d + i + 8), load_bf16_as_f32(s + i + 8));
    }
    axl_convert_bf16_f32_ref(s + i, d + i, n - i);
}

AXL_AVX2 void axl_convert_bf16_f16_avx2(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_castsi256_ps(load_bf16_as_f32(s + i));
        __m256 b = _mm256_castsi256_ps(load_bf16_as_f32(s + i + 8));
        _mm_storeu_si128((__m128i *)(d + i), f32_to_f16(a));
        _mm_storeu_si128((__m128i *)(d + i + 8), f32_to_f16(b));
    }
    axl_convert_bf16_f16_ref(s + i, d + i, n - i);
}

AXL_AVX2 void axl_convert_f16_f32_avx2(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    float *d = dst;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
        _mm256_storeu_ps(d + i + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i + 8))));
    }
    axl_convert_f16_f32_ref(s + i, d + i, n - i);
}

AXL_AVX2 void axl_convert_f16_bf16_avx2(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i)));
        __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i + 8)));
        __m256i r = pack16(bf16_round(_mm256_castps_si256(a)), bf16_round(_mm256_castps_si256(b)));
        _mm256_storeu_si256((__m256i *)(d + i), r);
    }
    axl_convert_f16_bf16_ref(s + i, d + i, n - i);
}

#endif /* AXL_X86 */
