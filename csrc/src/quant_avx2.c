/* quant_avx2.c - quantization and dequantization of a row with AVX2 + F16C, 16 elements per
 * step, the scalar helpers of internal.h for each block's set-up and for a row's tail.
 * Compiled for any x86 CPU (per-function target attributes); quant.c only calls these when
 * the CPU has AXL_NEEDS_AVX2. Bit for bit the arithmetic of quant_ref.c: the same IEEE
 * operations in the same order, no FMA (except where the product is exact: the statistics'
 * squares, see internal.h), and vcvtps2dq rounding in the round-to-nearest-even mode quant.c
 * sets. */
#include "internal.h"

#if AXL_X86
#include <immintrin.h>

#define AXL_AVX2 __attribute__((target("avx2,f16c,fma")))
#define INLINE static inline __attribute__((always_inline))

/* 8 elements of a src_dtype row from index k, widened to f32. */
AXL_AVX2 INLINE __m256 load8(const void *w, int src_dtype, int64_t k) {
    if (src_dtype == AXL_F32) return _mm256_loadu_ps((const float *)w + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
    if (src_dtype == AXL_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* One element, as quant_ref.c reads it. */
INLINE float load1(const void *w, int src_dtype, int64_t k) {
    if (src_dtype == AXL_F32) return ((const float *)w)[k];
    uint16_t h = ((const uint16_t *)w)[k];
    return axl_f32_from_bits(src_dtype == AXL_BF16 ? (uint32_t)h << 16 : axl_f16_to_f32_bits(h));
}

AXL_AVX2 INLINE uint32_t hmax_epu32(__m256i a) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

AXL_AVX2 INLINE float hmin_ps(__m256 a) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_min_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_min_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtss_f32(m);
}

AXL_AVX2 INLINE float hmax_ps(__m256 a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtss_f32(m);
}

/* 16 int32 in [-128, 127] (two vectors, in order) -> 16 int8. */
AXL_AVX2 INLINE __m128i to_bytes(__m256i a, __m256i b) {
    /* packs works per 128-bit lane; the permute puts the quarters back in order. */
    __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), _MM_SHUFFLE(3, 1, 2, 0));
    return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

/* 16 bytes of 4-bit values -> 8 bytes of nibble pairs (element 2j low, 2j+1 high). */
AXL_AVX2 INLINE __m128i pack_nibbles(__m128i b) {
    __m128i lo = _mm_and_si128(b, _mm_set1_epi16(0x000F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi16(0x00F0));
    __m128i pairs = _mm_or_si128(lo, hi);
    return _mm_packus_epi16(pairs, pairs);
}

/* Error statistics in 16 lanes: element k of the row in lane k % 16, 4 lanes a vector. */
typedef struct stats16 {
    __m256d signal[4], noise[4], max_abs_err[4];
} stats16;

AXL_AVX2 INLINE void stats_add4(stats16 *s, int i, __m128 x, __m128 dq) {
    __m256d xd = _mm256_cvtps_pd(x), e = _mm256_sub_pd(xd, _mm256_cvtps_pd(dq));
    s->signal[i] = _mm256_fmadd_pd(xd, xd, s->signal[i]); /* exact products: */
    s->noise[i] = _mm256_fmadd_pd(e, e, s->noise[i]);     /* see internal.h */
    __m256d a = _mm256_andnot_pd(_mm256_set1_pd(-0.0), e);
    s->max_abs_err[i] = _mm256_max_pd(s->max_abs_err[i], a);
}

AXL_AVX2 INLINE void stats_add16(stats16 *s, __m256 x0, __m256 x1, __m256 d0, __m256 d1) {
    stats_add4(s, 0, _mm256_castps256_ps128(x0), _mm256_castps256_ps128(d0));
    stats_add4(s, 1, _mm256_extractf128_ps(x0, 1), _mm256_extractf128_ps(d0, 1));
    stats_add4(s, 2, _mm256_castps256_ps128(x1), _mm256_castps256_ps128(d1));
    stats_add4(s, 3, _mm256_extractf128_ps(x1, 1), _mm256_extractf128_ps(d1, 1));
}

/* See axl_quant_row_fn in internal.h; src_dtype, bits, symmetric and stats are constants
 * after inlining. For rows of one block, or blocks of a multiple of 16 (quant_row_any), only
 * the row's last block can have a tail: its last < 16 elements, at most one per lane, which
 * the scalar code adds after the vector lanes, the order of quant_ref.c (the lanes are
 * positions within a block, and such blocks start at multiples of 16). */
AXL_AVX2 INLINE int quant_row(const void *w, int src_dtype, const axl_qformat *f, void *q,
                              void *scales, int8_t *zp, float *max_err, float *sqnr_db,
                              const int bits, const int symmetric, const int stats) {
    const int64_t block = f->block, groups = f->groups;
    const int32_t qmax = bits == 8 ? 127 : 7, qmin = symmetric ? -qmax : -qmax - 1;
    const __m256i qmin_v = _mm256_set1_epi32(qmin), qmax_v = _mm256_set1_epi32(qmax);
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    int8_t *q8 = q;
    uint8_t *q4 = q;
    stats16 st;
    for (int i = 0; i < 4; i++)
        st.signal[i] = st.noise[i] = st.max_abs_err[i] = _mm256_setzero_pd();
    double tail_signal[AXL_QLANES] = {0}, tail_noise[AXL_QLANES] = {0}, tail_max = 0;

    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * block, k1 = axl_block_end(f, g), kv = k0 + (k1 - k0) / 16 * 16;
        /* Pass 1: the block's range; |x| as integer bits, so no NaN or Inf hides. */
        __m256i a = _mm256_setzero_si256();
        __m256 l = _mm256_setzero_ps(), u = _mm256_setzero_ps();
        for (int64_t k = k0; k < kv; k += 16) {
            __m256 x0 = load8(w, src_dtype, k), x1 = load8(w, src_dtype, k + 8);
            a = _mm256_max_epu32(a, _mm256_and_si256(_mm256_castps_si256(x0), abs_mask));
            a = _mm256_max_epu32(a, _mm256_and_si256(_mm256_castps_si256(x1), abs_mask));
            if (!symmetric) {
                l = _mm256_min_ps(l, _mm256_min_ps(x0, x1));
                u = _mm256_max_ps(u, _mm256_max_ps(x0, x1));
            }
        }
        uint32_t amax = hmax_epu32(a);
        float lo = symmetric ? 0 : hmin_ps(l), hi = symmetric ? 0 : hmax_ps(u);
        for (int64_t k = kv; k < k1; k++) {
            axl_range_add(load1(w, src_dtype, k), &amax, &lo, &hi);
        }
        if (amax >= 0x7F800000u) return 1;
        float scale, inv;
        int32_t z = 0;
        if (symmetric)
            axl_qparams_sym(axl_f32_from_bits(amax), (float)qmax, f->scale_dtype, &scale, &inv);
        else if (axl_qparams_asym(lo, hi, qmin, qmax, f->scale_dtype, &scale, &inv, &z))
            return 1;
        /* A block whose grid, scale * qmax (symmetric) or scale * (qmax - qmin), overflows
         * fp32 (elements within about 2^-8 of FLT_MAX): its extreme values would dequantize
         * to Inf, so the row is non-finite. */
        if (scale * (float)(symmetric ? qmax : qmax - qmin) == INFINITY) return 1;
        axl_scale_store(scales, f->scale_dtype, g, scale);
        if (zp) zp[g] = (int8_t)z;

        /* Pass 2: the values and statistics, from cache. */
        const __m256 inv_v = _mm256_set1_ps(inv), scale_v = _mm256_set1_ps(scale);
        const __m256i zp_v = _mm256_set1_epi32(z);
        for (int64_t k = k0; k < kv; k += 16) {
            __m256 x0 = load8(w, src_dtype, k), x1 = load8(w, src_dtype, k + 8);
            __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, inv_v));
            __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, inv_v));
            if (!symmetric) {
                v0 = _mm256_add_epi32(v0, zp_v);
                v1 = _mm256_add_epi32(v1, zp_v);
            }
            v0 = _mm256_min_epi32(_mm256_max_epi32(v0, qmin_v), qmax_v);
            v1 = _mm256_min_epi32(_mm256_max_epi32(v1, qmin_v), qmax_v);
            __m128i bytes = to_bytes(v0, v1);
            if (bits == 8)
                _mm_storeu_si128((__m128i *)(q8 + k), bytes);
            else
                _mm_storel_epi64((__m128i *)(q4 + k / 2), pack_nibbles(bytes));
            if (stats) {
                __m256i d0 = symmetric ? v0 : _mm256_sub_epi32(v0, zp_v);
                __m256i d1 = symmetric ? v1 : _mm256_sub_epi32(v1, zp_v);
                stats_add16(&st, x0, x1, _mm256_mul_ps(_mm256_cvtepi32_ps(d0), scale_v),
                            _mm256_mul_ps(_mm256_cvtepi32_ps(d1), scale_v));
            }
        }
        for (int64_t k = kv; k < k1; k++) {
            float x = load1(w, src_dtype, k);
            int32_t v = axl_qvalue(x, inv, z, qmin, qmax);
            if (bits == 8)
                q8[k] = (int8_t)v;
            else if (k & 1)
                q4[k >> 1] |= (uint8_t)((v & 0xF) << 4);
            else
                q4[k >> 1] = (uint8_t)(v & 0xF);
            if (stats)
                axl_qstats_add(x, axl_dqvalue(v, z, scale), &tail_signal[k % AXL_QLANES],
                               &tail_noise[k % AXL_QLANES], &tail_max);
        }
    }
    if (stats) {
        double signal[AXL_QLANES], noise[AXL_QLANES], m[4];
        __m256d mv = _mm256_max_pd(_mm256_max_pd(st.max_abs_err[0], st.max_abs_err[1]),
                                   _mm256_max_pd(st.max_abs_err[2], st.max_abs_err[3]));
        _mm256_storeu_pd(m, mv);
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_pd(signal + 4 * i, st.signal[i]);
            _mm256_storeu_pd(noise + 4 * i, st.noise[i]);
            if (m[i] > tail_max) tail_max = m[i];
        }
        for (int l = 0; l < AXL_QLANES; l++) { /* the tail's one element per lane, last */
            signal[l] += tail_signal[l];
            noise[l] += tail_noise[l];
        }
        axl_qstats_finish(signal, noise, tail_max, max_err, sqnr_db);
    }
    return 0;
}

/* One specialisation per (bits, symmetric, stats). */
AXL_AVX2 INLINE int quant_row_any(const void *w, int src_dtype, const axl_qformat *f, void *q,
                                  void *scales, int8_t *zp, float *max_err, float *sqnr_db) {
    const int stats = max_err || sqnr_db;
    /* Several blocks with tails: each tail would have to join the lanes in order, which the
     * vector loop does not do; such (unusual) formats take the reference's path. */
    if (f->groups > 1 && f->block % 16)
        return axl_quant_row_ref_any(w, src_dtype, f, q, scales, zp, max_err, sqnr_db);
#define QR(b, sym, st) quant_row(w, src_dtype, f, q, scales, zp, max_err, sqnr_db, b, sym, st)
    if (f->bits == 8) {
        if (f->symmetric) return stats ? QR(8, 1, 1) : QR(8, 1, 0);
        return stats ? QR(8, 0, 1) : QR(8, 0, 0);
    }
    if (f->symmetric) return stats ? QR(4, 1, 1) : QR(4, 1, 0);
    return stats ? QR(4, 0, 1) : QR(4, 0, 0);
#undef QR
}

/* 16 stored values from element k of a row (k a multiple of 16) in two vectors. */
AXL_AVX2 INLINE void load_q16(const void *q, int64_t k, const int bits, __m256i *v0,
                              __m256i *v1) {
    if (bits == 8) {
        __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)q + k));
        *v0 = _mm256_cvtepi8_epi32(b);
        *v1 = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
        return;
    }
    __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)q + k / 2));
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    __m128i n = _mm_unpacklo_epi8(lo, hi); /* 16 nibbles in order */
    *v0 = _mm256_srai_epi32(_mm256_slli_epi32(_mm256_cvtepu8_epi32(n), 28), 28);
    *v1 = _mm256_srai_epi32(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(n, 8)), 28),
                            28);
}

/* Dequantized values are staged as f32 in this many elements, then converted by the
 * f32 -> dst_dtype kernel of convert_avx2.c (the rounding of axl_convert). */
#define STAGE 512

AXL_AVX2 INLINE void flush_stage(const float *stage, void *out, int64_t from, int64_t n,
                                 int dst_dtype) {
    uint16_t *dst = (uint16_t *)out + from;
    if (dst_dtype == AXL_BF16)
        axl_convert_f32_bf16_avx2(stage, dst, n);
    else
        axl_convert_f32_f16_avx2(stage, dst, n);
}

/* See axl_dequant_row_fn in internal.h. */
AXL_AVX2 INLINE void dequant_row(const void *q, const void *scales, const int8_t *zp,
                                 const axl_qformat *f, void *out, int dst_dtype,
                                 const int bits) {
    const int64_t block = f->block, groups = f->groups;
    float stage[STAGE];
    int64_t staged_from = 0, staged = 0; /* stage holds elements [staged_from, +staged) */
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * block, k1 = axl_block_end(f, g);
        /* 4-bit blocks that start on an odd element (odd block sizes): all scalar. */
        const int64_t kv = bits == 4 && (k0 & 1) ? k0 : k0 + (k1 - k0) / 16 * 16;
        const float scale = axl_scale_load(scales, f->scale_dtype, g);
        const int32_t z = zp ? zp[g] : 0;
        const __m256 scale_v = _mm256_set1_ps(scale);
        const __m256i zp_v = _mm256_set1_epi32(z);
        for (int64_t k = k0; k < kv; k += 16) {
            __m256i v0, v1;
            load_q16(q, k, bits, &v0, &v1);
            __m256 y0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v0, zp_v)), scale_v);
            __m256 y1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v1, zp_v)), scale_v);
            if (dst_dtype == AXL_F32) {
                _mm256_storeu_ps((float *)out + k, y0);
                _mm256_storeu_ps((float *)out + k + 8, y1);
                continue;
            }
            _mm256_storeu_ps(stage + staged, y0);
            _mm256_storeu_ps(stage + staged + 8, y1);
            staged += 16;
            if (staged == STAGE) {
                flush_stage(stage, out, staged_from, staged, dst_dtype);
                staged_from += staged;
                staged = 0;
            }
        }
        if (kv < k1 && dst_dtype != AXL_F32 && staged) { /* the tail follows the stage */
            flush_stage(stage, out, staged_from, staged, dst_dtype);
            staged_from += staged;
            staged = 0;
        }
        for (int64_t k = kv; k < k1; k++) {
            int32_t v = bits == 8 ? ((const int8_t *)q)[k]
                                  : axl_nibble_value((((const uint8_t *)q)[k >> 1] >> (4 * (k & 1))) & 0xFu);
            float y = axl_dqvalue(v, z, scale);
            if (dst_dtype == AXL_F32)
                ((float *)out)[k] = y;
            else if (dst_dtype == AXL_BF16)
                ((uint16_t *)out)[k] = axl_f32_bits_to_bf16(axl_bits_of_f32(y));
            else
                ((uint16_t *)out)[k] = axl_f32_bits_to_f16(axl_bits_of_f32(y));
            staged_from = k + 1;
        }
    }
    if (staged) flush_stage(stage, out, staged_from, staged, dst_dtype);
}

AXL_DEFINE_QUANT_ROWS(AXL_AVX2, avx2, f32, AXL_F32)
AXL_DEFINE_QUANT_ROWS(AXL_AVX2, avx2, bf16, AXL_BF16)
AXL_DEFINE_QUANT_ROWS(AXL_AVX2, avx2, f16, AXL_F16)

#endif /* AXL_X86 */
