/* quant_avx512.c - quantization and dequantization of a row with AVX-512. Blocks of a
 * multiple of 32 elements (every blockwise format, and most per-channel widths) take 32
 * elements per step without masks; other per-channel rows 16 per step with masked tails.
 * Compiled for any x86 CPU (per-function target attributes); quant.c only calls these when
 * the CPU has AXL_NEEDS_AVX512. Bit for bit the arithmetic of quant_ref.c: the same IEEE
 * operations in the same order, no FMA (except where the product is exact: the statistics'
 * squares, see internal.h), rounding by vcvtps2dq with embedded round-to-nearest-even, and
 * the same per-block set-up (16 blocks per vector). */
#include "internal.h"

#if AXL_X86
#include "avx512.h"

/* Blocks whose range is taken before any of them is quantized: their set-up is one vector. */
#define CHUNK 16

/* 16 bytes of 4-bit values (one per byte, in order) -> 8 bytes of nibble pairs: element
 * 2j in the low nibble of byte j, element 2j+1 in the high nibble. */
AXL_AVX512 INLINE __m128i pack_nibbles(__m128i b) {
    __m128i lo = _mm_and_si128(b, _mm_set1_epi16(0x000F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi16(0x00F0));
    __m128i pairs = _mm_or_si128(lo, hi);
    return _mm_packus_epi16(pairs, pairs);
}

/* The low 8 bytes of nibble pairs -> 16 values in 32-bit lanes, sign-extended. */
AXL_AVX512 INLINE __m512i unpack_nibbles(__m128i b) {
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    return _mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28);
}

/* Error statistics of 16 lanes: element k of the row in lane k % 16; lanes 0-7 in [0],
 * lanes 8-15 in [1]. */
typedef struct stats16 {
    __m512d signal[2], noise[2], max_abs_err[2];
} stats16;

/* max(m, |e|) for m >= 0 in one vrangepd: the larger magnitude, sign cleared. */
AXL_AVX512 INLINE __m512d max_abs(__m512d m, __m512d e) { return _mm512_range_pd(m, e, 0xB); }

AXL_AVX512 INLINE void stats_add(stats16 *s, __m512 x, __m512 dq) {
    __m512d xs[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(x)),
                     _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)))};
    __m512d ds[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(dq)),
                     _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dq), 1)))};
    for (int h = 0; h < 2; h++) {
        __m512d e = _mm512_sub_pd(xs[h], ds[h]);
        s->signal[h] = _mm512_fmadd_pd(xs[h], xs[h], s->signal[h]); /* exact products: */
        s->noise[h] = _mm512_fmadd_pd(e, e, s->noise[h]);          /* see internal.h */
        s->max_abs_err[h] = max_abs(s->max_abs_err[h], e);
    }
}

AXL_AVX512 INLINE void stats_finish(const stats16 *s, float *max_err, float *sqnr_db) {
    double signal[AXL_QLANES], noise[AXL_QLANES];
    _mm512_storeu_pd(signal, s->signal[0]);
    _mm512_storeu_pd(signal + 8, s->signal[1]);
    _mm512_storeu_pd(noise, s->noise[0]);
    _mm512_storeu_pd(noise + 8, s->noise[1]);
    double m = _mm512_reduce_max_pd(_mm512_max_pd(s->max_abs_err[0], s->max_abs_err[1]));
    axl_qstats_finish(signal, noise, m, max_err, sqnr_db);
}


/* Stores the lanes in `valid` of s (rounded by round_scales) as scales g0, g0 + 1, .. */
AXL_AVX512 INLINE void store_scales(void *scales, int scale_dtype, int64_t g0, __mmask16 valid,
                                    __m512 s) {
    if (scale_dtype == AXL_F32)
        _mm512_mask_storeu_ps((float *)scales + g0, valid, s);
    else if (scale_dtype == AXL_F16) /* exact: fp16 values */
        _mm256_mask_storeu_epi16((uint16_t *)scales + g0, valid,
                                 _mm512_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else /* exact: the low 16 bits are 0 */
        _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)scales + g0, valid,
                                          _mm512_srli_epi32(_mm512_castps_si512(s), 16));
}

/* Set-up of up to CHUNK blocks at once (lanes in `valid`), as axl_qparams_sym /
 * axl_qparams_asym: from the fp32 scales s (and, asymmetric, the blocks' lo), the stored
 * scales (rounded to f->scale_dtype), their reciprocals (0 for a zero block), the zero points;
 * stores scales and zero points for blocks g0.., and spills inv, scale and zp for pass 2.
 * Returns nonzero if a block's grid overflows (as quant_ref.c: its extreme values would
 * dequantize to Inf), and then the row is non-finite. */
AXL_AVX512 INLINE int block_setup(__m512 s, __m512 lo, __mmask16 valid, const axl_qformat *f,
                                   int symmetric, int32_t qmin, int32_t qmax, void *scales,
                                   int8_t *zp,
                                   int64_t g0, float inv[CHUNK], float scale[CHUNK],
                                   int32_t zpi[CHUNK]) {
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __m512 inf = _mm512_set1_ps(INFINITY);
    s = round_scales(s, f->scale_dtype);
    __mmask16 pos = _mm512_mask_cmp_ps_mask(valid, s, zero, _CMP_GT_OQ);
    __m512 r = _mm512_maskz_div_ps(pos, one, s);
    __mmask16 ok = _mm512_mask_cmp_ps_mask(pos, r, inf, _CMP_LT_OQ);
    s = _mm512_maskz_mov_ps(ok, s);
    r = _mm512_maskz_mov_ps(ok, r);
    const __m512 range = _mm512_set1_ps((float)(symmetric ? qmax : qmax - qmin));
    if (_mm512_mask_cmp_ps_mask(valid, _mm512_mul_ps(s, range), inf, _CMP_EQ_OQ)) return 1;
    __m512i z = _mm512_setzero_si512();
    if (!symmetric) {
        const __m512i qmin_v = _mm512_set1_epi32(qmin), qmax_v = _mm512_set1_epi32(qmax);
        z = _mm512_sub_epi32(qmin_v, _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, r), RNE));
        z = _mm512_min_epi32(_mm512_max_epi32(z, qmin_v), qmax_v);
        z = _mm512_maskz_mov_epi32(ok, z);
    }
    store_scales(scales, f->scale_dtype, g0, valid, s);
    if (zp) _mm512_mask_cvtepi32_storeu_epi8(zp + g0, valid, z);
    _mm512_storeu_ps(inv, r);
    _mm512_storeu_ps(scale, s);
    _mm512_storeu_si512(zpi, z);
    return 0;
}

/* Any block size, 16 elements per step with masked tails: for per-channel rows whose width
 * is not a multiple of 32. Clamps everything, as the reference does. See axl_quant_row_fn in
 * internal.h. */
AXL_AVX512 INLINE int quant_row_masked(const void *w, int src_dtype, const axl_qformat *f,
                                       void *q, void *scales, int8_t *zp, float *max_err,
                                       float *sqnr_db, const int bits, const int symmetric,
                                       const int stats) {
    const int64_t block = f->block, groups = f->groups;
    const int32_t qmax = bits == 8 ? 127 : 7, qmin = symmetric ? -qmax : -qmax - 1;
    const __m512i qmin_v = _mm512_set1_epi32(qmin), qmax_v = _mm512_set1_epi32(qmax);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512 zero = _mm512_setzero_ps();
    const __m512 inf = _mm512_set1_ps(INFINITY);
    int8_t *q8 = q;
    uint8_t *q4 = q;
    stats16 st;
    for (int h = 0; h < 2; h++)
        st.signal[h] = st.noise[h] = st.max_abs_err[h] = _mm512_setzero_pd();

    for (int64_t g0 = 0; g0 < groups; g0 += CHUNK) {
        const int nb = groups - g0 < CHUNK ? (int)(groups - g0) : CHUNK;
        const __mmask16 valid = first_lanes(nb);
        /* Pass 1: each block's range; |x| as integer bits, so no NaN or Inf hides. */
        uint32_t amax[CHUNK];
        float lo[CHUNK], hi[CHUNK];
        for (int b = 0; b < nb; b++) {
            const int64_t k0 = (g0 + b) * block, k1 = axl_block_end(f, g0 + b);
            __m512i a = _mm512_setzero_si512();
            __m512 l = zero, u = zero; /* masked-out lanes are 0: neutral, 0 is in range */
            for (int64_t k = k0; k < k1; k += 16) {
                __m512 x = load_x(w, src_dtype, k, first_lanes(k1 - k));
                a = _mm512_max_epu32(a, _mm512_and_si512(_mm512_castps_si512(x), abs_mask));
                if (!symmetric) {
                    l = _mm512_min_ps(l, x);
                    u = _mm512_max_ps(u, x);
                }
            }
            amax[b] = _mm512_reduce_max_epu32(a);
            if (!symmetric) {
                lo[b] = _mm512_reduce_min_ps(l);
                hi[b] = _mm512_reduce_max_ps(u);
            }
        }
        __m512i av = _mm512_maskz_loadu_epi32(valid, amax);
        if (_mm512_mask_cmpge_epu32_mask(valid, av, _mm512_set1_epi32(0x7F800000))) return 1;

        /* Set-up of the nb blocks at once, as axl_qparams_sym / axl_qparams_asym. */
        __m512 s;
        if (symmetric) {
            s = _mm512_div_ps(_mm512_castsi512_ps(av), _mm512_set1_ps((float)qmax));
        } else {
            __m512 l = _mm512_maskz_loadu_ps(valid, lo), u = _mm512_maskz_loadu_ps(valid, hi);
            s = _mm512_div_ps(_mm512_sub_ps(u, l), _mm512_set1_ps((float)(qmax - qmin)));
            if (_mm512_mask_cmp_ps_mask(valid, s, inf, _CMP_EQ_OQ)) return 1;
        }
        float inv[CHUNK], scale[CHUNK];
        int32_t zpi[CHUNK];
        if (block_setup(s, symmetric ? zero : _mm512_maskz_loadu_ps(valid, lo), valid, f,
                        symmetric, qmin, qmax, scales, zp, g0, inv, scale, zpi))
            return 1;

        /* Pass 2: the values and statistics, from cache. */
        for (int b = 0; b < nb; b++) {
            const int64_t k0 = (g0 + b) * block, k1 = axl_block_end(f, g0 + b);
            const __m512 inv_v = _mm512_set1_ps(inv[b]), scale_v = _mm512_set1_ps(scale[b]);
            const __m512i zp_v = _mm512_set1_epi32(zpi[b]);
            for (int64_t k = k0; k < k1; k += 16) {
                const __mmask16 m = first_lanes(k1 - k);
                __m512 x = load_x(w, src_dtype, k, m);
                __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x, inv_v), RNE);
                if (!symmetric) v = _mm512_add_epi32(v, zp_v);
                v = _mm512_min_epi32(_mm512_max_epi32(v, qmin_v), qmax_v);
                if (bits == 8) {
                    _mm512_mask_cvtepi32_storeu_epi8(q8 + k, m, v);
                } else {
                    v = _mm512_maskz_mov_epi32(m, v); /* the padding nibble is 0 */
                    __m128i packed = pack_nibbles(_mm512_cvtepi32_epi8(v));
                    int64_t n = k1 - k < 16 ? k1 - k : 16;
                    _mm_mask_storeu_epi8(q4 + k / 2, (__mmask16)((1u << ((n + 1) / 2)) - 1),
                                         packed);
                }
                if (stats) {
                    __m512i d = symmetric ? v : _mm512_sub_epi32(v, zp_v);
                    /* Masked-out lanes: x = 0 and dq = 0, so they add nothing. */
                    stats_add(&st, x, _mm512_maskz_mul_ps(m, _mm512_cvtepi32_ps(d), scale_v));
                }
            }
        }
    }
    if (stats) stats_finish(&st, max_err, sqnr_db);
    return 0;
}

/* ---- blocks of a multiple of 32 elements -------------------------------------------------
 * The common case (every blockwise format, and per-channel rows of a width that is a
 * multiple of 32): 32 elements per step, no masks.
 *
 * Pass 1 works on order-preserving integer keys of the source bits: for a sign-magnitude
 * value b (16 or 32 bits) key(b) = b ^ (sign(b) ? 0x7FFF..F : 0) compares as a signed
 * integer exactly as the values compare (with -0 just below +0, which no result depends
 * on), key(+0) = 0, and NaN/Inf map beyond key(+-Inf). So min/max of keys started at 0
 * give min(min(block), 0) and max(max(block), 0) and catch every NaN and Inf; for 16-bit
 * sources they run on 32 elements per instruction. Symmetric blocks take the max of |b|.
 * The 16 blocks of a chunk are then reduced at once (reduce16 below). */

/* A bf16 row is loaded as two f32 vectors of its even and odd elements: no widening. f32
 * and f16 rows are loaded in order (elements 0-15, 16-31). */
#define EVEN_ODD(src) ((src) == AXL_BF16)

AXL_AVX512 INLINE void load32(const void *w, int src_dtype, int64_t k, __m512 *x0, __m512 *x1) {
    if (src_dtype == AXL_F32) {
        *x0 = _mm512_loadu_ps((const float *)w + k);
        *x1 = _mm512_loadu_ps((const float *)w + k + 16);
    } else if (src_dtype == AXL_BF16) {
        __m512i b = _mm512_loadu_si512((const uint16_t *)w + k);
        *x0 = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));                           /* even */
        *x1 = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000))); /* odd */
    } else {
        __m512i h = _mm512_loadu_si512((const uint16_t *)w + k);
        *x0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        *x1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    }
}

/* key(b) of 16-bit lanes: b ^ ((b >> 15, arithmetic) & 0x7FFF); its own inverse. */
AXL_AVX512 INLINE __m512i key16(__m512i b) {
    /* ternary logic 0x78: A ^ (B & C) */
    return _mm512_ternarylogic_epi32(b, _mm512_srai_epi16(b, 15), _mm512_set1_epi16(0x7FFF), 0x78);
}

AXL_AVX512 INLINE __m512i key32(__m512i b) {
    return _mm512_ternarylogic_epi32(b, _mm512_srai_epi32(b, 31), _mm512_set1_epi32(0x7FFFFFFF),
                                     0x78);
}

enum { OP_MAXU, OP_MIN, OP_MAX, OP_MAXU16, OP_MIN16 }; /* 32-bit lanes; 16-bit lanes */

AXL_AVX512 INLINE __m512i op_lanes(int op, __m512i a, __m512i b) {
    switch (op) {
    case OP_MAXU: return _mm512_max_epu32(a, b);
    case OP_MIN: return _mm512_min_epi32(a, b);
    case OP_MAX: return _mm512_max_epi32(a, b);
    case OP_MAXU16: return _mm512_max_epu16(a, b);
    default: return _mm512_min_epi16(a, b);
    }
}

/* The tree below halves the 32-bit lanes per vector while pairing vectors; a 16-bit op
 * reduces both halves of each 32-bit lane separately. After rounds 1-3 of 8 vectors,
 * 128-bit lane j holds v[j] in dwords 0-1 and v[4 + j] in dwords 2-3. */
AXL_AVX512 INLINE __m512i tree8(int op, const __m512i v[8]) {
    __m512i u[4], t[2];
    for (int i = 0; i < 4; i++) /* [v 2i: 8 dwords | v 2i+1: 8 dwords] */
        u[i] = op_lanes(op, _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                        _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++) /* 128-bit lane j: 4 dwords of v[4i + j] */
        t[i] = op_lanes(op, _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return op_lanes(op, _mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
}

/* Dword b of the result = op over the 16 dwords of v[b], for 16 vectors at once (46
 * instructions, against about 128 for 16 separate horizontal reductions). */
AXL_AVX512 INLINE __m512i reduce16(int op, const __m512i v[16]) {
    __m512i s[2] = {tree8(op, v), tree8(op, v + 8)};
    /* 128-bit lane j, dword m: v[4m + j] */
    __m512 a = _mm512_castsi512_ps(s[0]), b = _mm512_castsi512_ps(s[1]);
    __m512i r = op_lanes(op, _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))),
                         _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_epi32(order, r);
}

/* Dword b (of 8) of the result = op over the 16 dwords of v[b]. */
AXL_AVX512 INLINE __m256i reduce8(int op, const __m512i v[8]) {
    __m512i s = tree8(op, v);
    s = op_lanes(op, s, _mm512_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    /* 128-bit lane j: v[j] in dword 0, v[4 + j] in dword 2 */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, s));
}

/* Each 32-bit lane of a (16-bit lanes) folded into its low 16 bits by a 16-bit op. */
AXL_AVX512 INLINE __m512i fold_pairs(int op, __m512i a) {
    return op_lanes(op, a, op == OP_MAXU16 ? _mm512_srli_epi32(a, 16) : _mm512_srai_epi32(a, 16));
}

/* The low 16 bits of each 32-bit lane of a in the low half, of b in the high half. */
AXL_AVX512 INLINE __m512i join_pairs(__m512i a, __m512i b) {
    return _mm512_mask_mov_epi16(a, (__mmask32)0xAAAAAAAAu, _mm512_slli_epi32(b, 16));
}

/* 16-bit source bits in 32-bit lanes -> f32 (exact). */
AXL_AVX512 INLINE __m512 bits16_to_f32(int src_dtype, __m512i b) {
    if (src_dtype == AXL_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(b));
}

/* Error statistics of a 32-element step: x0/x1 and dq0/dq1 in the load32 layout. In
 * order (f32, f16) x0 holds lanes 0-15 and x1 the next 16 elements, lanes 0-15 again; in
 * even/odd (bf16) x0 holds elements 0, 2, .. 30, i.e. lanes 0, 2, .. 14 twice, and x1 the
 * odd lanes. Either way each lane receives its elements in row order. */
AXL_AVX512 INLINE void stats_add32(stats16 *s, int even_odd, __m512 x0, __m512 x1, __m512 d0,
                                   __m512 d1) {
    if (!even_odd) {
        stats_add(s, x0, d0);
        stats_add(s, x1, d1);
        return;
    }
    /* signal[0]/noise[0] accumulate the even lanes, [1] the odd ones. */
    const __m512 xs[2] = {x0, x1}, ds[2] = {d0, d1};
    for (int h = 0; h < 2; h++)
        for (int half = 0; half < 2; half++) {
            __m256 xv = half ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(xs[h]), 1))
                             : _mm512_castps512_ps256(xs[h]);
            __m256 dv = half ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ds[h]), 1))
                             : _mm512_castps512_ps256(ds[h]);
            __m512d xd = _mm512_cvtps_pd(xv), e = _mm512_sub_pd(xd, _mm512_cvtps_pd(dv));
            s->signal[h] = _mm512_fmadd_pd(xd, xd, s->signal[h]);
            s->noise[h] = _mm512_fmadd_pd(e, e, s->noise[h]);
            s->max_abs_err[h] = max_abs(s->max_abs_err[h], e);
        }
}

/* The lanes in order (lane l in signal[l], noise[l]) and the largest |error|. */
AXL_AVX512 INLINE void stats_export32(const stats16 *s, int even_odd, double *signal,
                                      double *noise, double *max_abs_err) {
    *max_abs_err = _mm512_reduce_max_pd(_mm512_max_pd(s->max_abs_err[0], s->max_abs_err[1]));
    if (!even_odd) {
        _mm512_storeu_pd(signal, s->signal[0]);
        _mm512_storeu_pd(signal + 8, s->signal[1]);
        _mm512_storeu_pd(noise, s->noise[0]);
        _mm512_storeu_pd(noise + 8, s->noise[1]);
        return;
    }
    double e[8], o[8];
    _mm512_storeu_pd(e, s->signal[0]);
    _mm512_storeu_pd(o, s->signal[1]);
    for (int j = 0; j < 8; j++) signal[2 * j] = e[j], signal[2 * j + 1] = o[j];
    _mm512_storeu_pd(e, s->noise[0]);
    _mm512_storeu_pd(o, s->noise[1]);
    for (int j = 0; j < 8; j++) noise[2 * j] = e[j], noise[2 * j + 1] = o[j];
}

/* Two vectors of int32 values in [-2^15, 2^15) (load32 layout) -> 32 int16 in element
 * order, one word permute. */
AXL_AVX512 INLINE __m512i to_words(int even_odd, __m512i v0, __m512i v1) {
    /* Word j of the result: the low word of the int32 holding element j; words 32.. are v1's. */
    const __m512i eo = _mm512_set_epi16(62, 30, 60, 28, 58, 26, 56, 24, 54, 22, 52, 20, 50, 18,
                                        48, 16, 46, 14, 44, 12, 42, 10, 40, 8, 38, 6, 36, 4, 34,
                                        2, 32, 0);
    const __m512i nat = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36,
                                         34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6,
                                         4, 2, 0);
    return _mm512_permutex2var_epi16(v0, even_odd ? eo : nat, v1);
}

/* 32 int16 values in [-8, 7], in order -> 16 bytes of nibble pairs. */
AXL_AVX512 INLINE __m128i nibbles32(__m512i w) {
    /* Per 32-bit lane (elements 2j, 2j+1): low nibble from bits 0-3, high from bits 16-19
     * moved to 4-7; ternary logic 0xE4 is C ? A : B, bit by bit; vpmovdb keeps bits 0-7. */
    __m512i pair = _mm512_ternarylogic_epi32(w, _mm512_srli_epi32(w, 12), _mm512_set1_epi32(0xF), 0xE4);
    return _mm512_cvtepi32_epi8(pair);
}

/* Even/odd int32 values in [-8, 7] -> 16 bytes of nibble pairs (lane j: elements 2j, 2j+1). */
AXL_AVX512 INLINE __m128i nibbles_eo(__m512i even, __m512i odd) {
    __m512i pair = _mm512_ternarylogic_epi32(even, _mm512_slli_epi32(odd, 4), _mm512_set1_epi32(0xF), 0xE4);
    return _mm512_cvtepi32_epi8(pair);
}

/* Clamps the vector code leaves out, proven for both scale dtypes. Let s be a block's fp32
 * scale and `scale` the one it uses: s itself (AXL_F32), or s rounded UP to bf16 (AXL_BF16),
 * so scale >= s either way. A kept scale has a finite 1 / scale, so scale > 2^-128. fp32
 * values (subnormals included) are at most 2^-149 apart, so the exact quotient (amax / qmax,
 * resp. (hi - lo) / (qmax - qmin) with hi - lo already rounded, by at most 2^-24 relative)
 * is at most s + 2^-150 <= scale + 2^-150 < scale (1 + 2^-22). With the fp32 roundings of
 * inv = 1 / scale and of x * inv (2^-24 relative each), |x| <= amax, resp. |lo| <= hi - lo,
 * give
 *   symmetric:  |x * inv|  <= qmax (1 + 2^-21) < qmax + 1/2;
 *   asymmetric: |lo * inv| <= (qmax - qmin)(1 + 2^-20) < qmax - qmin + 1/2
 * (a bf16 scale exceeds s by up to 2^-8 relative, or 2^-5 for the smallest kept scales,
 * bf16 subnormals: that only makes these smaller and the grid coarser). Hence:
 *   symmetric: |nearbyint(x * inv)| <= qmax: no clamp binds.
 *   asymmetric: nearbyint(lo * inv) lies in [-(qmax - qmin), 0], so zp = qmin -
 *     nearbyint(lo * inv) never needs its clamp (the set-up applies it anyway, as the
 *     reference does: two instructions per 16 blocks); x >= lo and rounding is monotonic, so
 *     nearbyint(x * inv) + zp >= qmin: only the upper clamp can bind, by 1, when both ends
 *     round away (and then x is within half a step, plus fp32 rounding, of qmax's value).
 *     int4 clamps q to <= qmax; int8 stores with signed saturation (the clamp to
 *     [-128, 127]); the statistics clamp q - zp to <= qmax - zp.
 * The scalar reference clamps everything; the tests check that both agree bit for bit, with
 * both scale dtypes, on blocks built to be as close to each bound as they can (test_quant.c),
 * and that no element ends up more than half a step (plus fp32 rounding) from its value. */

AXL_AVX512 INLINE void store32(void *p, __m256i v, int stream) {
    if (stream)
        _mm256_stream_si256((__m256i *)p, v);
    else
        _mm256_storeu_si256((__m256i *)p, v);
}

AXL_AVX512 INLINE void store16(void *p, __m128i v, int stream) {
    if (stream)
        _mm_stream_si128((__m128i *)p, v);
    else
        _mm_storeu_si128((__m128i *)p, v);
}

/* Pass 2 of one block, elements [k0, k1) of the row (k1 - k0 a multiple of 32): its q and
 * statistics, with the block's inv, scale and zero point; prefetches the line at `ahead` and
 * those after it (one per 32 elements of 16-bit source, two of f32) and returns the address
 * that follows. */
AXL_AVX512 INLINE uintptr_t quant_block(const void *w, int src_dtype, int64_t k0, int64_t k1,
                                        float inv, float scale, int32_t zp, uintptr_t ahead,
                                        void *q, int stream, stats16 *st, const int bits,
                                        const int symmetric, const int stats) {
    const int eo = EVEN_ODD(src_dtype), wide = src_dtype == AXL_F32;
    const int32_t qmax = bits == 8 ? 127 : 7;
    const uintptr_t step_bytes = wide ? 128 : 64; /* per 32 elements */
    int8_t *q8 = q;
    uint8_t *q4 = q;
    const __m512 inv_v = _mm512_set1_ps(inv), scale_v = _mm512_set1_ps(scale);
    const __m512i zp16 = _mm512_set1_epi16((short)zp);
    const __m512i qmax16 = _mm512_set1_epi16((short)qmax);
    /* The statistics' q - zp: v clamped to qmax - zp (see above). */
    const __m512i dhi = _mm512_set1_epi32(qmax - zp);
    for (int64_t k = k0; k < k1; k += 32) {
        /* An address, not a C pointer: it may lie past the end of the weight. */
        _mm_prefetch((const char *)ahead, _MM_HINT_T0);
        if (wide) _mm_prefetch((const char *)(ahead + 64), _MM_HINT_T0);
        ahead += step_bytes;
        __m512 x0, x1;
        load32(w, src_dtype, k, &x0, &x1);
        __m512i v0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x0, inv_v), RNE);
        __m512i v1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x1, inv_v), RNE);
        if (bits == 4 && eo && symmetric) { /* nibble pairs from the even/odd lanes */
            store16(q4 + k / 2, nibbles_eo(v0, v1), stream);
        } else {
            /* |v| <= 2^9: exact in int16; + zp and the clamp there. */
            __m512i w16 = to_words(eo, v0, v1);
            if (!symmetric) w16 = _mm512_add_epi16(w16, zp16);
            if (bits == 8) /* saturating: the asymmetric clamp to [-128, 127] */
                store32(q8 + k, _mm512_cvtsepi16_epi8(w16), stream);
            else
                store16(q4 + k / 2, nibbles32(symmetric ? w16 : _mm512_min_epi16(w16, qmax16)),
                        stream);
        }
        if (stats) {
            __m512i d0 = symmetric ? v0 : _mm512_min_epi32(v0, dhi);
            __m512i d1 = symmetric ? v1 : _mm512_min_epi32(v1, dhi);
            stats_add32(st, eo, x0, x1, _mm512_mul_ps(_mm512_cvtepi32_ps(d0), scale_v),
                        _mm512_mul_ps(_mm512_cvtepi32_ps(d1), scale_v));
        }
    }
    return ahead;
}

/* fixed_block: the block size as a compile-time constant (common sizes, so that the inner
 * loops unroll), or 0 to read it from f. f->scale_dtype says how the scales are rounded and
 * stored; the loops are the same for both (see above). */
AXL_AVX512 INLINE int quant_row_fast(const void *w, int src_dtype, const axl_qformat *f,
                                     void *q, void *scales, int8_t *zp, float *max_err,
                                     float *sqnr_db, const int bits, const int symmetric,
                                     const int stats, const int64_t fixed_block) {
    const int64_t block = fixed_block ? fixed_block : f->block;
    /* The full blocks; a short last block (ragged rows) is the reference's, below. */
    const int64_t groups = f->cols / block;
    const int eo = EVEN_ODD(src_dtype), wide = src_dtype == AXL_F32;
    const int32_t qmax = bits == 8 ? 127 : 7, qmin = symmetric ? -qmax : -qmax - 1;
    const __m512 zero = _mm512_setzero_ps();
    const __m512 inf = _mm512_set1_ps(INFINITY);
    /* Bits (as keys) of +Inf and -Inf: beyond them lie NaNs. */
    const int32_t pos_inf = wide ? 0x7F800000 : src_dtype == AXL_BF16 ? 0x7F80 : 0x7C00;
    const int32_t neg_inf_key = wide ? (int32_t)0x807FFFFF : src_dtype == AXL_BF16 ? -32641 : -31745;
    /* Non-temporal stores of q when it is large and this row's stores are aligned (every
     * store covers 32 elements: 32 bytes, or 16 for 4 bits). */
    const int stream = f->stream && (uintptr_t)q % (bits == 8 ? 32 : 16) == 0;
    stats16 st;
    for (int h = 0; h < 2; h++)
        st.signal[h] = st.noise[h] = st.max_abs_err[h] = _mm512_setzero_pd();

    for (int64_t g0 = 0; g0 < groups; g0 += CHUNK) {
        const int nb = groups - g0 < CHUNK ? (int)(groups - g0) : CHUNK;
        const __mmask16 valid = first_lanes(nb);
        /* Pass 1: one vector per block (unused blocks 0), reduced 16 blocks at a time.
         * 16-bit symmetric: the max |bits| of two blocks share a vector (low and high
         * halves of each dword). 16-bit asymmetric: a block's min key in the low half, NOT
         * its max key in the high half (NOT reverses the order), so one min reduces both.
         * f32: 32-bit lanes, one reduction per quantity. */
        __m512i acc_a[CHUNK], acc_b[CHUNK];
        for (int b = symmetric && !wide ? (nb + 1) / 2 : nb; b < CHUNK; b++)
            acc_a[b] = acc_b[b] = _mm512_setzero_si512();
        for (int b = 0; b < nb; b++) {
            const int64_t k0 = (g0 + b) * block, k1 = k0 + block;
            __m512i a = _mm512_setzero_si512(), c = _mm512_setzero_si512();
            if (wide) {
                const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
                for (int64_t k = k0; k < k1; k += 32) {
                    __m512i b0 = _mm512_loadu_si512((const float *)w + k);
                    __m512i b1 = _mm512_loadu_si512((const float *)w + k + 16);
                    if (symmetric) {
                        a = _mm512_max_epu32(a, _mm512_and_si512(b0, abs_mask));
                        a = _mm512_max_epu32(a, _mm512_and_si512(b1, abs_mask));
                    } else {
                        __m512i y0 = key32(b0), y1 = key32(b1);
                        a = _mm512_min_epi32(a, _mm512_min_epi32(y0, y1));
                        c = _mm512_max_epi32(c, _mm512_max_epi32(y0, y1));
                    }
                }
                acc_a[b] = a;
                acc_b[b] = c;
                continue;
            }
            for (int64_t k = k0; k < k1; k += 32) {
                __m512i h = _mm512_loadu_si512((const uint16_t *)w + k);
                if (symmetric) {
                    a = _mm512_max_epu16(a, _mm512_and_si512(h, _mm512_set1_epi16(0x7FFF)));
                } else {
                    __m512i y = key16(h);
                    a = _mm512_min_epi16(a, y);
                    c = _mm512_max_epi16(c, y);
                }
            }
            if (symmetric) {
                a = fold_pairs(OP_MAXU16, a);
                if (b & 1)
                    acc_a[b / 2] = join_pairs(acc_a[b / 2], a);
                else
                    acc_a[b / 2] = _mm512_and_si512(a, _mm512_set1_epi32(0xFFFF));
            } else {
                __m512i not_c = _mm512_ternarylogic_epi32(c, c, c, 0x55); /* ~c */
                acc_a[b] = join_pairs(fold_pairs(OP_MIN16, a),
                                      _mm512_min_epi16(not_c, _mm512_srai_epi32(not_c, 16)));
            }
        }

        /* Set-up of the nb blocks at once, as axl_qparams_sym / axl_qparams_asym. */
        __m512 s, lo = zero;
        if (symmetric) {
            __m512i amax = wide ? reduce16(OP_MAXU, acc_a)
                                : _mm512_cvtepu16_epi32(reduce8(OP_MAXU16, acc_a));
            if (_mm512_mask_cmpge_epi32_mask(valid, amax, _mm512_set1_epi32(pos_inf))) return 1;
            __m512 a = wide ? _mm512_castsi512_ps(amax) : bits16_to_f32(src_dtype, amax);
            s = _mm512_div_ps(a, _mm512_set1_ps((float)qmax));
        } else {
            __m512i kl, kh;
            if (wide) {
                kl = reduce16(OP_MIN, acc_a);
                kh = reduce16(OP_MAX, acc_b);
            } else {
                __m512i r = reduce16(OP_MIN16, acc_a);
                kl = _mm512_srai_epi32(_mm512_slli_epi32(r, 16), 16);
                kh = _mm512_ternarylogic_epi32(r, r, r, 0x55); /* ~(~max) */
                kh = _mm512_srai_epi32(kh, 16);
            }
            if (_mm512_mask_cmpge_epi32_mask(valid, kh, _mm512_set1_epi32(pos_inf)) ||
                _mm512_mask_cmple_epi32_mask(valid, kl, _mm512_set1_epi32(neg_inf_key)))
                return 1;
            __m512 hi;
            if (wide) {
                lo = _mm512_castsi512_ps(key32(kl));
                hi = _mm512_castsi512_ps(key32(kh));
            } else { /* sign-extended keys of 16-bit values: back to the 16-bit patterns */
                lo = bits16_to_f32(src_dtype, _mm512_and_si512(key16(kl), _mm512_set1_epi32(0xFFFF)));
                hi = bits16_to_f32(src_dtype, _mm512_and_si512(key16(kh), _mm512_set1_epi32(0xFFFF)));
            }
            s = _mm512_div_ps(_mm512_sub_ps(hi, lo), _mm512_set1_ps((float)(qmax - qmin)));
            if (_mm512_mask_cmp_ps_mask(valid, s, inf, _CMP_EQ_OQ)) return 1;
        }
        float inv[CHUNK], scale[CHUNK];
        int32_t zpi[CHUNK];
        if (block_setup(s, lo, valid, f, symmetric, qmin, qmax, scales, zp, g0, inv, scale, zpi))
            return 1;

        /* Pass 2: the values and statistics, from cache. Meanwhile the lines pass 1 reads
         * next (the next chunk, or row: rows are contiguous) are prefetched, so the memory
         * keeps streaming while this pass computes. Prefetches never fault. */
        uintptr_t ahead = (uintptr_t)w + (uintptr_t)((g0 + nb) * block) * (wide ? 4 : 2);
        for (int b = 0; b < nb; b++) {
            const int64_t k0 = (g0 + b) * block;
            ahead = quant_block(w, src_dtype, k0, k0 + block, inv[b], scale[b], zpi[b], ahead, q,
                                stream, &st, bits, symmetric, stats);
        }
    }
    if (stream) _mm_sfence(); /* order the streamed q before the caller's next reads */
    double signal[AXL_QLANES], noise[AXL_QLANES], m = 0;
    if (stats) stats_export32(&st, eo, signal, noise, &m);
    /* The short last block: its elements are the last of each lane, as in the reference. */
    if (groups < f->groups &&
        axl_quant_block_ref(w, src_dtype, f, groups, q, scales, zp, stats ? signal : NULL, noise,
                            &m))
        return 1;
    if (stats) axl_qstats_finish(signal, noise, m, max_err, sqnr_db);
    return 0;
}

/* Blocks of a multiple of 32 elements, by block size. */
AXL_AVX512 INLINE int quant_row_blocks(const void *w, int src_dtype, const axl_qformat *f,
                                       void *q, void *scales, int8_t *zp, float *max_err,
                                       float *sqnr_db, const int bits, const int symmetric,
                                       const int stats) {
#define QF(fixed)                                                                           \
    quant_row_fast(w, src_dtype, f, q, scales, zp, max_err, sqnr_db, bits, symmetric, stats, \
                   fixed)
    if (f->block == 32) return QF(32);
    if (f->block == 64) return QF(64);
    return QF(0);
#undef QF
}

/* See axl_quant_row_fn in internal.h; src_dtype, bits, symmetric and stats are constants
 * after inlining, so each combination is its own loop. */
AXL_AVX512 INLINE int quant_row(const void *w, int src_dtype, const axl_qformat *f, void *q,
                                void *scales, int8_t *zp, float *max_err, float *sqnr_db,
                                const int bits, const int symmetric, const int stats) {
    if (f->block % 32 == 0)
        return quant_row_blocks(w, src_dtype, f, q, scales, zp, max_err, sqnr_db, bits,
                                symmetric, stats);
    return quant_row_masked(w, src_dtype, f, q, scales, zp, max_err, sqnr_db, bits, symmetric,
                            stats);
}

/* One specialisation per (bits, symmetric, stats). */
AXL_AVX512 INLINE int quant_row_any(const void *w, int src_dtype, const axl_qformat *f, void *q,
                                    void *scales, int8_t *zp, float *max_err, float *sqnr_db) {
    const int stats = max_err || sqnr_db;
    /* 4-bit blocks of an odd size start on odd elements, half-way into a byte: the vector
     * loops store whole bytes, so these (unusual) formats take the reference's path. */
    if (f->bits == 4 && f->groups > 1 && (f->block & 1))
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

/* Dequantized values are staged as f32 in this many elements, then converted by the
 * f32 -> dst_dtype kernel of convert_avx512.c (the rounding of axl_convert). */
#define STAGE 512

/* Converts the staged elements into out from element *from on, and empties the stage. */
AXL_AVX512 INLINE void flush_stage(const float *stage, void *out, int64_t *from, int64_t *n,
                                   int dst_dtype) {
    uint16_t *dst = (uint16_t *)out + *from;
    if (dst_dtype == AXL_BF16)
        axl_convert_f32_bf16_avx512(stage, dst, *n);
    else
        axl_convert_f32_f16_avx512(stage, dst, *n);
    *from += *n;
    *n = 0;
}

/* See axl_dequant_row_fn in internal.h. */
AXL_AVX512 INLINE void dequant_row(const void *q, const void *scales, const int8_t *zp,
                                   const axl_qformat *f, void *out, int dst_dtype,
                                   const int bits) {
    const int64_t block = f->block, groups = f->groups;
    const int8_t *q8 = q;
    const uint8_t *q4 = q;
    float stage[STAGE];
    int64_t staged_from = 0, staged = 0; /* stage holds elements [staged_from, +staged) */
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * block, k1 = axl_block_end(f, g);
        const float scale = axl_scale_load(scales, f->scale_dtype, g);
        const int32_t z = zp ? zp[g] : 0;
        if (bits == 4 && (k0 & 1)) { /* starts half-way into a byte (odd blocks): scalar */
            for (int64_t k = k0; k < k1; k++) {
                float y = axl_dqvalue(axl_nibble_value((q4[k >> 1] >> (4 * (k & 1))) & 0xFu), z,
                                      scale);
                if (dst_dtype == AXL_F32) {
                    ((float *)out)[k] = y;
                    continue;
                }
                if (staged == STAGE) flush_stage(stage, out, &staged_from, &staged, dst_dtype);
                stage[staged++] = y;
            }
            continue;
        }
        const __m512 scale_v = _mm512_set1_ps(scale);
        const __m512i zp_v = _mm512_set1_epi32(z);
        for (int64_t k = k0; k < k1; k += 16) {
            const int64_t n = k1 - k < 16 ? k1 - k : 16;
            const __mmask16 m = first_lanes(n);
            __m512i v;
            if (bits == 8)
                v = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q8 + k));
            else
                v = unpack_nibbles(
                    _mm_maskz_loadu_epi8((__mmask16)((1u << ((n + 1) / 2)) - 1), q4 + k / 2));
            __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v, zp_v)), scale_v);
            if (dst_dtype == AXL_F32) {
                _mm512_mask_storeu_ps((float *)out + k, m, y);
                continue;
            }
            /* Every element passes through the stage in order (short steps at block ends). */
            if (staged + 16 > STAGE) flush_stage(stage, out, &staged_from, &staged, dst_dtype);
            _mm512_mask_storeu_ps(stage + staged, m, y);
            staged += n;
        }
    }
    if (staged) flush_stage(stage, out, &staged_from, &staged, dst_dtype);
}

/* ---- the search's inner loops (quant_search.c; the semantics on axl_qsearch_ops) --------
 * 16 elements per step from the block's start, lane j = position % 16, masked tails (masked
 * lanes add nothing); the same fp32 / double operations in the same order as the reference. */

AXL_AVX512 INLINE __m512i search_levels(__m512 x, const axl_qcand *c, __m512i lo_q, __m512i hi_q) {
    __m512 t = _mm512_mul_ps(_mm512_sub_ps(x, _mm512_set1_ps(c->a)), _mm512_set1_ps(c->inv));
    __m512i v = _mm512_add_epi32(_mm512_cvt_roundps_epi32(t, RNE), _mm512_set1_epi32(c->zp));
    return _mm512_min_epi32(_mm512_max_epi32(v, lo_q), hi_q);
}

/* The candidates side by side, one per lane (unused lanes compute harmless zeros): each
 * lane's sums see the elements in order, as the reference's loop per candidate does. */
AXL_AVX512 INLINE void search_sums_any(const void *w, int src_dtype, const float *imp, int64_t k0,
                                       int64_t k1, const axl_qcand *c, const int32_t *lo_q,
                                       const int32_t *hi_q, int n, float out[3][AXL_QCANDS]) {
    float inv[AXL_QCANDS] = {0}, a[AXL_QCANDS] = {0};
    int32_t zp[AXL_QCANDS] = {0}, lo[AXL_QCANDS] = {0}, hi[AXL_QCANDS] = {0};
    for (int i = 0; i < n; i++) {
        inv[i] = c[i].inv;
        a[i] = c[i].a;
        zp[i] = c[i].zp;
        lo[i] = lo_q[i];
        hi[i] = hi_q[i];
    }
    const __m512 inv_v = _mm512_loadu_ps(inv), a_v = _mm512_loadu_ps(a);
    const __m512i zp_v = _mm512_loadu_si512(zp), lo_v = _mm512_loadu_si512(lo);
    const __m512i hi_v = _mm512_loadu_si512(hi);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0;
    for (int64_t k = k0; k < k1; k++) {
        const float x = src_dtype == AXL_F32    ? ((const float *)w)[k]
                        : src_dtype == AXL_BF16 ? axl_f32_from_bits((uint32_t)((const uint16_t *)w)[k] << 16)
                                                : axl_f32_from_bits(axl_f16_to_f32_bits(((const uint16_t *)w)[k]));
        const float wt = imp ? imp[k] : 1.0f;
        const __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(x), a_v), inv_v);
        __m512i v = _mm512_add_epi32(_mm512_cvt_roundps_epi32(t, RNE), zp_v);
        v = _mm512_min_epi32(_mm512_max_epi32(v, lo_v), hi_v);
        const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(v, zp_v)), wt_v = _mm512_set1_ps(wt);
        s0 = _mm512_add_ps(s0, _mm512_mul_ps(_mm512_set1_ps(wt * x), d));
        s1 = _mm512_add_ps(s1, _mm512_mul_ps(wt_v, _mm512_mul_ps(d, d)));
        s2 = _mm512_add_ps(s2, _mm512_mul_ps(wt_v, d));
    }
    _mm512_storeu_ps(out[0], s0);
    _mm512_storeu_ps(out[1], s1);
    _mm512_storeu_ps(out[2], s2);
}

AXL_AVX512 INLINE void search_error_any(const void *w, int src_dtype, const float *imp,
                                        int64_t k0, int64_t k1, const axl_qcand *c, int32_t lo_q,
                                        int32_t hi_q, int offset, double lanes[AXL_QLANES]) {
    __m512d e0 = _mm512_loadu_pd(lanes), e1 = _mm512_loadu_pd(lanes + 8);
    const __m512i lo_v = _mm512_set1_epi32(lo_q), hi_v = _mm512_set1_epi32(hi_q);
    const __m512i zp_v = _mm512_set1_epi32(c->zp);
    const __m512 scale_v = _mm512_set1_ps(c->scale), b_v = _mm512_set1_ps(c->b);
    for (int64_t k = k0; k < k1; k += 16) {
        const __mmask16 m = first_lanes(k1 - k);
        const __m512 x = load_x(w, src_dtype, k, m);
        const __m512 wt = imp ? _mm512_maskz_loadu_ps(m, imp + k) : _mm512_set1_ps(1.0f);
        __m512 y = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_sub_epi32(search_levels(x, c, lo_v, hi_v), zp_v)), scale_v);
        if (offset) y = _mm512_add_ps(y, b_v);
        const __m512d d0 = _mm512_sub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)),
                                         _mm512_cvtps_pd(_mm512_castps512_ps256(y)));
        const __m512d d1 = _mm512_sub_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1)),
                                         _mm512_cvtps_pd(_mm512_extractf32x8_ps(y, 1)));
        const __m512d t0 = _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(wt)),
                                         _mm512_mul_pd(d0, d0));
        const __m512d t1 = _mm512_mul_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(wt, 1)),
                                         _mm512_mul_pd(d1, d1));
        e0 = _mm512_mask_add_pd(e0, (__mmask8)m, e0, t0);
        e1 = _mm512_mask_add_pd(e1, (__mmask8)(m >> 8), e1, t1);
    }
    _mm512_storeu_pd(lanes, e0);
    _mm512_storeu_pd(lanes + 8, e1);
}

/* One specialisation per source dtype. */
#define SEARCH_BY_DTYPE(call)                   \
    switch (src_dtype) {                        \
    case AXL_F32: call(AXL_F32); break;         \
    case AXL_BF16: call(AXL_BF16); break;       \
    default: call(AXL_F16); break;              \
    }

AXL_AVX512 static void search_sums(const void *w, int src_dtype, const float *imp, int64_t k0,
                                   int64_t k1, const axl_qcand *c, const int32_t *lo_q,
                                   const int32_t *hi_q, int n, float out[3][AXL_QCANDS]) {
#define CALL(dt) search_sums_any(w, dt, imp, k0, k1, c, lo_q, hi_q, n, out)
    SEARCH_BY_DTYPE(CALL)
#undef CALL
}

AXL_AVX512 static void search_error(const void *w, int src_dtype, const float *imp, int64_t k0,
                                    int64_t k1, const axl_qcand *c, int32_t lo_q, int32_t hi_q,
                                    int offset, double lanes[AXL_QLANES]) {
#define CALL(dt)                                                                    \
    (offset ? search_error_any(w, dt, imp, k0, k1, c, lo_q, hi_q, 1, lanes)         \
            : search_error_any(w, dt, imp, k0, k1, c, lo_q, hi_q, 0, lanes))
    SEARCH_BY_DTYPE(CALL)
#undef CALL
}

AXL_AVX512 INLINE void search_range_any(const void *w, int src_dtype, const float *imp,
                                        int64_t k0, int64_t k1, int offset, uint32_t *amax,
                                        float *mn, float *mx, float lw[AXL_QLANES],
                                        float lx[AXL_QLANES]) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i a = _mm512_setzero_si512();
    __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY);
    __m512 sw = _mm512_loadu_ps(lw), sx = _mm512_loadu_ps(lx);
    for (int64_t k = k0; k < k1; k += 16) {
        const __mmask16 m = first_lanes(k1 - k);
        const __m512 x = load_x(w, src_dtype, k, m); /* masked lanes 0: |0| adds nothing */
        a = _mm512_max_epu32(a, _mm512_and_si512(_mm512_castps_si512(x), abs_mask));
        lo = _mm512_mask_min_ps(lo, m, lo, x);
        hi = _mm512_mask_max_ps(hi, m, hi, x);
        if (offset) {
            const __m512 wt = imp ? _mm512_maskz_loadu_ps(m, imp + k) : _mm512_set1_ps(1.0f);
            sw = _mm512_mask_add_ps(sw, m, sw, wt);
            sx = _mm512_mask_add_ps(sx, m, sx, _mm512_mul_ps(wt, x));
        }
    }
    /* NaNs aside (they show in amax and refuse the row), min and max ignore the order. */
    *amax = _mm512_reduce_max_epu32(a);
    *mn = _mm512_reduce_min_ps(lo);
    *mx = _mm512_reduce_max_ps(hi);
    _mm512_storeu_ps(lw, sw);
    _mm512_storeu_ps(lx, sx);
}

AXL_AVX512 INLINE void search_write_any(const void *w, int src_dtype, int64_t k0, int64_t k1,
                                        const axl_qcand *c, int32_t lo_q, int32_t hi_q,
                                        int offset, int bits, void *q, double *signal,
                                        double *noise, double *max_abs_err) {
    if (bits == 4 && (k0 & 1)) { /* starts half-way into a byte */
        axl_qsearch_write_ref(w, src_dtype, k0, k1, c, lo_q, hi_q, offset, bits, q, signal, noise,
                              max_abs_err);
        return;
    }
    int8_t *q8 = q;
    uint8_t *q4 = q;
    const __m512i lo_v = _mm512_set1_epi32(lo_q), hi_v = _mm512_set1_epi32(hi_q);
    const __m512i zp_v = _mm512_set1_epi32(c->zp);
    const __m512 scale_v = _mm512_set1_ps(c->scale), b_v = _mm512_set1_ps(c->b);
    /* Read only when signal is given; zeroed so the compiler can see they are set. */
    __m512d sg[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()}, ns[2] = {sg[0], sg[0]},
            mx[2] = {sg[0], sg[0]};
    if (signal)
        for (int h = 0; h < 2; h++) {
            sg[h] = _mm512_loadu_pd(signal + 8 * h);
            ns[h] = _mm512_loadu_pd(noise + 8 * h);
            mx[h] = _mm512_set1_pd(*max_abs_err);
        }
    for (int64_t k = k0; k < k1; k += 16) {
        const int64_t n = k1 - k < 16 ? k1 - k : 16;
        const __mmask16 m = first_lanes(n);
        const __m512 x = load_x(w, src_dtype, k, m);
        __m512i v = search_levels(x, c, lo_v, hi_v);
        if (bits == 8) {
            _mm512_mask_cvtepi32_storeu_epi8(q8 + k, m, v);
        } else {
            __m128i packed = pack_nibbles(_mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(m, v)));
            _mm_mask_storeu_epi8(q4 + k / 2, (__mmask16)((1u << ((n + 1) / 2)) - 1), packed);
        }
        if (!signal) continue;
        __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v, zp_v)), scale_v);
        if (offset) y = _mm512_add_ps(y, b_v);
        const __m512d xs[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(x)),
                               _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1))};
        const __m512d ys[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(y)),
                               _mm512_cvtps_pd(_mm512_extractf32x8_ps(y, 1))};
        const __mmask8 mh[2] = {(__mmask8)m, (__mmask8)(m >> 8)};
        for (int h = 0; h < 2; h++) { /* no FMA: e * e need not be exact here */
            const __m512d e = _mm512_sub_pd(xs[h], ys[h]);
            sg[h] = _mm512_mask_add_pd(sg[h], mh[h], sg[h], _mm512_mul_pd(xs[h], xs[h]));
            ns[h] = _mm512_mask_add_pd(ns[h], mh[h], ns[h], _mm512_mul_pd(e, e));
            mx[h] = _mm512_mask_range_pd(mx[h], mh[h], mx[h], e, 0xB);
        }
    }
    if (signal) {
        for (int h = 0; h < 2; h++) {
            _mm512_storeu_pd(signal + 8 * h, sg[h]);
            _mm512_storeu_pd(noise + 8 * h, ns[h]);
        }
        *max_abs_err = _mm512_reduce_max_pd(_mm512_max_pd(mx[0], mx[1]));
    }
}

AXL_AVX512 static void search_range(const void *w, int src_dtype, const float *imp, int64_t k0,
                                    int64_t k1, int offset, uint32_t *amax, float *mn, float *mx,
                                    float lw[AXL_QLANES], float lx[AXL_QLANES]) {
#define CALL(dt) search_range_any(w, dt, imp, k0, k1, offset, amax, mn, mx, lw, lx)
    SEARCH_BY_DTYPE(CALL)
#undef CALL
}

AXL_AVX512 static void search_write(const void *w, int src_dtype, int64_t k0, int64_t k1,
                                    const axl_qcand *c, int32_t lo_q, int32_t hi_q, int offset,
                                    int bits, void *q, double *signal, double *noise,
                                    double *max_abs_err) {
#define CALL(dt)                                                                             \
    (bits == 8 ? search_write_any(w, dt, k0, k1, c, lo_q, hi_q, offset, 8, q, signal, noise,  \
                                  max_abs_err)                                               \
               : search_write_any(w, dt, k0, k1, c, lo_q, hi_q, offset, 4, q, signal, noise,  \
                                  max_abs_err))
    SEARCH_BY_DTYPE(CALL)
#undef CALL
}

const axl_qsearch_ops axl_qsearch_avx512 = {search_sums, search_error, search_range, search_write,
                                            axl_qsearch_group_avx512};

AXL_DEFINE_QUANT_ROWS(AXL_AVX512, avx512, f32, AXL_F32)
AXL_DEFINE_QUANT_ROWS(AXL_AVX512, avx512, bf16, AXL_BF16)
AXL_DEFINE_QUANT_ROWS(AXL_AVX512, avx512, f16, AXL_F16)

#endif /* AXL_X86 */
