/* quant_search_avx512.c - the set-up and search of quant_search.c for 16 blocks of a row at
 * once with AVX-512, one block per lane (axl_qsearch_ops.group): the 16 blocks are transposed
 * into a tile (element p of every block in one vector), and then each lane runs its block's
 * range, plain parameters, candidates, sums (in element order), refit and ranking (double,
 * 2 x 8 lanes), the two exact error passes and the choice, with the reference's IEEE
 * operations in the reference's order (no FMA) and masks for its branches, so that every lane
 * gets the bits quant_search.c gives its block. Levels are rounded and clamped as floats
 * (vrndscaleps): the same integers as the reference's, which only rounds values below 2^9 in
 * magnitude for the candidates it keeps; a -0 level is harmless (every use is a product added
 * to a sum that is never -0, or squared). */
#include "internal.h"

#if AXL_X86
#include "avx512.h"

#define ROUND_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* rows r[j] -> columns: r[c] lane j = old r[j] lane c (unpacks, then 128-bit shuffles). */
AXL_AVX512 INLINE void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++)
        for (int h = 0; h < 2; h++) {
            __m512d a = _mm512_castps_pd(t[4 * i + h]), b = _mm512_castps_pd(t[4 * i + 2 + h]);
            u[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            u[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    for (int m = 0; m < 4; m++) {
        __m512 v = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88);
        __m512 v2 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xDD);
        __m512 w = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88);
        __m512 w2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xDD);
        r[m] = _mm512_shuffle_f32x4(v, w, 0x88);
        r[8 + m] = _mm512_shuffle_f32x4(v, w, 0xDD);
        r[4 + m] = _mm512_shuffle_f32x4(v2, w2, 0x88);
        r[12 + m] = _mm512_shuffle_f32x4(v2, w2, 0xDD);
    }
}

/* 16 elements of dtype dt at p, widened to f32. */
AXL_AVX512 INLINE __m512 load16(const char *p, const int dt) {
    if (dt == AXL_F32) return _mm512_loadu_ps(p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (dt == AXL_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* tile[p * 16 + j] = element p of the j-th of 16 blocks of b elements from element `base`. */
AXL_AVX512 INLINE void load_tile_any(const void *w, const int dt, int64_t base, int64_t b,
                                     float *tile) {
    const size_t es = dt == AXL_F32 ? 4 : 2, stride = (size_t)b * es;
    const char *src = (const char *)w + (size_t)base * es;
    if (b % 16 == 0) {
        for (int64_t p0 = 0; p0 < b; p0 += 16) {
            __m512 r[16];
            const char *at = src + (size_t)p0 * es;
            for (int j = 0; j < 16; j++, at += stride) r[j] = load16(at, dt);
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_store_ps(tile + (p0 + c) * 16, r[c]);
        }
        return;
    }
    for (int j = 0; j < 16; j++)
        for (int64_t p = 0; p < b; p++) {
            const int64_t k = base + j * b + p;
            tile[p * 16 + j] =
                dt == AXL_F32    ? ((const float *)w)[k]
                : dt == AXL_BF16 ? axl_f32_from_bits((uint32_t)((const uint16_t *)w)[k] << 16)
                                 : axl_f32_from_bits(axl_f16_to_f32_bits(((const uint16_t *)w)[k]));
        }
}

AXL_AVX512 static void load_tile(const void *w, int dt, int64_t base, int64_t b, float *tile) {
    switch (dt) {
    case AXL_F32: load_tile_any(w, AXL_F32, base, b, tile); break;
    case AXL_BF16: load_tile_any(w, AXL_BF16, base, b, tile); break;
    default: load_tile_any(w, AXL_F16, base, b, tile); break;
    }
}

AXL_AVX512 INLINE __mmask16 finite(__m512 v) {
    return _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_EQ_OQ);
}

/* round_nearest of quant_search.c: nearest-even scale_dtype value (+-Inf past fp16), NaN kept. */
AXL_AVX512 INLINE __m512 nearest(__m512 v, int scale_dtype) {
    if (scale_dtype == AXL_F32) return v;
    if (scale_dtype == AXL_F16) return _mm512_cvtph_ps(_mm512_cvt_roundps_ph(v, ROUND_RNE));
    const __m512i x = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb);
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
}

AXL_AVX512 INLINE __m512d half_pd(__m512 v, int h) {
    return _mm512_cvtps_pd(h ? _mm512_extractf32x8_ps(v, 1) : _mm512_castps512_ps256(v));
}

AXL_AVX512 INLINE __m512 join_ps(__m512d a, __m512d b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(a)), _mm512_cvtpd_ps(b), 1);
}

/* A candidate per lane: levels clamp(round((x - a) * inv) + zp, lo, hi) - zp, all as floats. */
typedef struct vcand {
    __m512 inv, a, zp, lo, hi, scale, b;
} vcand;

/* clamp: which bounds a candidate's levels may reach (CLAMP_BOTH unless shown otherwise). */
enum { CLAMP_NONE = 0, CLAMP_HI = 1, CLAMP_BOTH = 3 };

AXL_AVX512 INLINE __m512 vlevel(__m512 x, const vcand *c, const int scheme, const int clamp) {
    __m512 t = scheme == AXL_Q_OFFSET ? _mm512_sub_ps(x, c->a) : x; /* a = 0 otherwise */
    __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(t, c->inv), ROUND_RNE);
    if (scheme == AXL_Q_ZERO_POINT) v = _mm512_add_ps(v, c->zp);
    if (clamp & 2) v = _mm512_max_ps(v, c->lo);
    if (clamp & 1) v = _mm512_min_ps(v, c->hi);
    return scheme == AXL_Q_ZERO_POINT ? _mm512_sub_ps(v, c->zp) : v;
}

/* The clamps candidate i (0: the plain levels) of the symmetric scheme can reach. With
 * |x| <= |m| and inv = fl(t / m), |x * inv| <= |t| (1 + 2^-24)^2 < |t| + 2^-20, which rounds to
 * at most |t| = N + 1 (the extreme side: qmin, never below), to N for |t| <= N + 1/4: only
 * t = -(N + 1), -(N + 3/4), -(N + 1/2) can pass qmax. The plain levels: |x| / s <= N (1 + 2^-22)
 * rounds within [-N, N]. */
static inline int sym_clamp(int i) { return i >= 1 && i <= 3 ? CLAMP_HI : CLAMP_NONE; }

/* measure() of quant_search.c per lane: lanes p % 16 in double, then the same tree. xd: the
 * tile as doubles (xd[k * 16 + j], lanes 0-7 then 8-15). */
AXL_AVX512 INLINE void vmeasure(const float *xt, const double *xd, const float *wt, int64_t b,
                                const vcand *c, const int scheme, const int weighted,
                                const int clamp, __m512d e[2]) {
    __m512d l[16][2];
    for (int p = 0; p < 16; p++) {
        __m512d acc[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
        for (int64_t k = p; k < b; k += 16) {
            const __m512 x = _mm512_load_ps(xt + k * 16);
            __m512 y = _mm512_mul_ps(vlevel(x, c, scheme, clamp), c->scale);
            if (scheme == AXL_Q_OFFSET) y = _mm512_add_ps(y, c->b);
            for (int h = 0; h < 2; h++) {
                const __m512d d = _mm512_sub_pd(_mm512_load_pd(xd + k * 16 + 8 * h), half_pd(y, h));
                __m512d v = _mm512_mul_pd(d, d);
                if (weighted) v = _mm512_mul_pd(half_pd(_mm512_load_ps(wt + k * 16), h), v);
                acc[h] = _mm512_add_pd(acc[h], v);
            }
        }
        l[p][0] = acc[0];
        l[p][1] = acc[1];
    }
    for (int h = 0; h < 2; h++) {
        __m512d t[8];
        for (int i = 0; i < 8; i++) t[i] = _mm512_add_pd(l[i][h], l[i + 8][h]);
        for (int i = 0; i < 4; i++) t[i] = _mm512_add_pd(t[i], t[i + 4]);
        for (int i = 0; i < 2; i++) t[i] = _mm512_add_pd(t[i], t[i + 2]);
        e[h] = _mm512_add_pd(t[0], t[1]);
    }
}

AXL_AVX512 INLINE __m512 vblend(__mmask16 m, __m512 a, __m512 b) {
    return _mm512_mask_mov_ps(a, m, b);
}

/* The 16 blocks from tiles xt (and wt, the importance, when weighted). See axl_qgroup_fn. */
AXL_AVX512 INLINE int group_any(const float *xt, const float *wt, int64_t b,
                                const axl_qformat *f, axl_qcand *out, int32_t *lo_out,
                                int32_t *hi_out, const int scheme, const int weighted) {
    enum { NC_MAX = 10 };
    const int offset = scheme == AXL_Q_OFFSET, sd = f->scale_dtype;
    const int nc = 1 + (scheme == AXL_Q_SYMMETRIC ? 9 : 6);
    const int32_t qmax = axl_qmax(f), qmin = -qmax - 1;
    const float n = (float)qmax, r = 2 * n + 1;
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __m512 inf = _mm512_set1_ps(INFINITY), ninf = _mm512_set1_ps(-INFINITY);
    const __m512 qmin_v = _mm512_set1_ps((float)qmin), qmax_v = _mm512_set1_ps((float)qmax);

    /* range_ref and plain_block */
    __m512i amax = _mm512_setzero_si512();
    __m512 mn = inf, mx = ninf;
    for (int64_t k = 0; k < b; k++) {
        const __m512 x = _mm512_load_ps(xt + k * 16);
        amax = _mm512_max_epu32(amax, _mm512_and_si512(_mm512_castps_si512(x),
                                                       _mm512_set1_epi32(0x7FFFFFFF)));
        mn = _mm512_min_ps(mn, x);
        mx = _mm512_max_ps(mx, x);
    }
    if (_mm512_cmpge_epu32_mask(amax, _mm512_set1_epi32(0x7F800000))) return 1;
    mn = _mm512_add_ps(mn, zero);
    mx = _mm512_add_ps(mx, zero);
    __m512 sw = zero, sx = zero;
    if (offset && f->search)
        for (int p = 0; p < 16; p++) { /* lane_sum_f of lanes p % 16 */
            __m512 lw = zero, lx = zero;
            for (int64_t k = p; k < b; k += 16) {
                const __m512 x = _mm512_load_ps(xt + k * 16);
                const __m512 wk = weighted ? _mm512_load_ps(wt + k * 16) : one;
                lw = _mm512_add_ps(lw, wk);
                lx = _mm512_add_ps(lx, weighted ? _mm512_mul_ps(wk, x) : x);
            }
            sw = p ? _mm512_add_ps(sw, lw) : lw;
            sx = p ? _mm512_add_ps(sx, lx) : lx;
        }
    const __m512 lo0 = _mm512_min_ps(mn, zero), hi0 = _mm512_max_ps(mx, zero);
    vcand pl = {zero, zero, zero, qmin_v, qmax_v, zero, zero};
    {
        const float levels = scheme == AXL_Q_SYMMETRIC ? n : (float)(qmax - qmin);
        __m512 s;
        if (scheme == AXL_Q_SYMMETRIC) {
            s = _mm512_div_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(n));
            pl.lo = _mm512_set1_ps((float)-qmax);
        } else {
            s = _mm512_div_ps(scheme == AXL_Q_OFFSET ? _mm512_sub_ps(mx, mn) : _mm512_sub_ps(hi0, lo0),
                              _mm512_set1_ps(levels));
            if (_mm512_cmp_ps_mask(s, inf, _CMP_EQ_OQ)) return 1;
        }
        s = round_scales(s, sd);
        const __mmask16 pos = _mm512_cmp_ps_mask(s, zero, _CMP_GT_OQ);
        __m512 rs = _mm512_maskz_div_ps(pos, one, s);
        const __mmask16 ok = _mm512_mask_cmp_ps_mask(pos, rs, inf, _CMP_LT_OQ);
        pl.scale = _mm512_maskz_mov_ps(ok, s);
        pl.inv = _mm512_maskz_mov_ps(ok, rs);
        if (_mm512_cmp_ps_mask(_mm512_mul_ps(pl.scale, _mm512_set1_ps(levels)), inf, _CMP_EQ_OQ))
            return 1;
        if (scheme == AXL_Q_ZERO_POINT) {
            __m512 z = _mm512_sub_ps(qmin_v, _mm512_roundscale_ps(_mm512_mul_ps(lo0, pl.inv), ROUND_RNE));
            pl.zp = _mm512_maskz_mov_ps(ok, _mm512_min_ps(_mm512_max_ps(z, qmin_v), qmax_v));
        } else if (offset) {
            pl.b = nearest(_mm512_sub_ps(mn, _mm512_mul_ps(qmin_v, pl.scale)), sd);
            if (_mm512_cmp_ps_mask(_mm512_abs_ps(pl.b), inf, _CMP_EQ_OQ)) return 1;
            pl.a = pl.b;
        }
    }
    __m512 best[7] = {pl.inv, pl.a, pl.zp, pl.lo, pl.hi, pl.scale, pl.b};
    const __mmask16 search = f->search ? _mm512_cmp_ps_mask(pl.scale, zero, _CMP_NEQ_UQ) : 0;

    if (search) {
        /* candidate() of quant_search.c; [0] the plain levels */
        vcand c[NC_MAX];
        __mmask16 valid[NC_MAX];
        c[0] = pl;
        valid[0] = search;
        if (scheme == AXL_Q_SYMMETRIC) {
            static const float t_neg[6] = {1.0f, 0.75f, 0.5f, 0.25f, 0.0f, -0.5f};
            static const float t_pos[3] = {-0.25f, -0.5f, -1.0f};
            const __m512 neg_lo = _mm512_castsi512_ps(
                _mm512_xor_si512(_mm512_castps_si512(lo0), _mm512_set1_epi32((int)0x80000000)));
            const __m512 m = vblend(_mm512_cmp_ps_mask(hi0, neg_lo, _CMP_GE_OQ), lo0, hi0);
            for (int i = 0; i < 9; i++) {
                const float t = i < 6 ? -(n + t_neg[i]) : n + t_pos[i - 6];
                c[1 + i] = (vcand){_mm512_div_ps(_mm512_set1_ps(t), m), zero, zero, qmin_v, qmax_v, zero, zero};
            }
        } else {
            static const float t_range[6] = {0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f};
            const __m512 lo = offset ? mn : lo0, hi = offset ? mx : hi0;
            const __m512 center = _mm512_add_ps(_mm512_mul_ps(lo, _mm512_set1_ps(0.5f)),
                                                _mm512_mul_ps(hi, _mm512_set1_ps(0.5f)));
            const __m512 width = _mm512_sub_ps(hi, lo);
            for (int i = 0; i < 6; i++) {
                vcand ci = {_mm512_div_ps(_mm512_set1_ps(r + t_range[i]), width), zero, zero, qmin_v,
                            qmax_v, zero, zero};
                if (offset) {
                    ci.a = _mm512_add_ps(center, _mm512_div_ps(_mm512_set1_ps(0.5f), ci.inv));
                } else {
                    __m512 z = _mm512_roundscale_ps(
                        _mm512_sub_ps(_mm512_set1_ps(-0.5f), _mm512_mul_ps(center, ci.inv)), ROUND_RNE);
                    ci.zp = _mm512_min_ps(_mm512_max_ps(z, qmin_v), qmax_v);
                }
                c[1 + i] = ci;
            }
        }
        for (int i = 1; i < nc; i++) valid[i] = search & finite(c[i].inv);

        /* sums_ref: every candidate's three sums, each lane in element order */
        __m512 s0[NC_MAX], s1[NC_MAX], s2[NC_MAX];
        for (int i = 0; i < nc; i++) s0[i] = s1[i] = s2[i] = zero;
        for (int64_t k = 0; k < b; k++) {
            const __m512 x = _mm512_load_ps(xt + k * 16);
            const __m512 wk = weighted ? _mm512_load_ps(wt + k * 16) : one;
            const __m512 wx = weighted ? _mm512_mul_ps(wk, x) : x;
            for (int i = 0; i < nc; i++) {
                const __m512 d = vlevel(x, &c[i], scheme,
                                        scheme == AXL_Q_SYMMETRIC ? sym_clamp(i) : CLAMP_BOTH);
                s0[i] = _mm512_add_ps(s0[i], _mm512_mul_ps(wx, d));
                const __m512 dd = _mm512_mul_ps(d, d);
                s1[i] = _mm512_add_ps(s1[i], weighted ? _mm512_mul_ps(wk, dd) : dd);
                if (offset) s2[i] = _mm512_add_ps(s2[i], weighted ? _mm512_mul_ps(wk, d) : d);
            }
        }

        /* search_block's refit and ranking, in double, 8 lanes per half */
        const __m512d two = _mm512_set1_pd(2.0);
        __m512d pick_j[2] = {_mm512_set1_pd(INFINITY), _mm512_set1_pd(INFINITY)};
        __m512d swd[2], sxd[2];
        for (int h = 0; h < 2; h++) {
            swd[h] = half_pd(sw, h);
            sxd[h] = half_pd(sx, h);
        }
        vcand pick = pl;
        __mmask16 found = 0;
        for (int i = 0; i < nc; i++) {
            __m512d sxl[2], sll[2], sl[2], sc[2], off[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
            __mmask8 okd[2];
            for (int h = 0; h < 2; h++) {
                sxl[h] = half_pd(s0[i], h);
                sll[h] = half_pd(s1[i], h);
                sl[h] = half_pd(s2[i], h);
                if (offset) {
                    const __m512d det = _mm512_sub_pd(_mm512_mul_pd(swd[h], sll[h]), _mm512_mul_pd(sl[h], sl[h]));
                    okd[h] = _mm512_cmp_pd_mask(det, _mm512_setzero_pd(), _CMP_GT_OQ);
                    sc[h] = _mm512_div_pd(_mm512_sub_pd(_mm512_mul_pd(swd[h], sxl[h]), _mm512_mul_pd(sxd[h], sl[h])), det);
                    off[h] = _mm512_div_pd(_mm512_sub_pd(_mm512_mul_pd(sll[h], sxd[h]), _mm512_mul_pd(sl[h], sxl[h])), det);
                } else {
                    okd[h] = _mm512_cmp_pd_mask(sll[h], _mm512_setzero_pd(), _CMP_GT_OQ);
                    sc[h] = _mm512_div_pd(sxl[h], sll[h]);
                }
            }
            const __m512 cs = nearest(join_ps(sc[0], sc[1]), sd);
            const __m512 cb = offset ? nearest(join_ps(off[0], off[1]), sd) : zero;
            __mmask16 ok = valid[i] & (__mmask16)(okd[0] | (okd[1] << 8)) & finite(cs) & finite(cb) &
                           _mm512_cmp_ps_mask(cs, zero, _CMP_NEQ_UQ);
            __mmask8 better[2];
            for (int h = 0; h < 2; h++) {
                const __m512d s = half_pd(cs, h), o = half_pd(cb, h);
                const __m512d s2x = _mm512_mul_pd(two, s);
                __m512d j = _mm512_sub_pd(_mm512_mul_pd(_mm512_mul_pd(s, s), sll[h]), _mm512_mul_pd(s2x, sxl[h]));
                if (offset) {
                    const __m512d add = _mm512_add_pd(_mm512_mul_pd(_mm512_mul_pd(s2x, o), sl[h]),
                                                      _mm512_mul_pd(_mm512_mul_pd(o, o), swd[h]));
                    j = _mm512_add_pd(j, _mm512_sub_pd(add, _mm512_mul_pd(_mm512_mul_pd(two, o), sxd[h])));
                }
                better[h] = _mm512_mask_cmp_pd_mask((__mmask8)(ok >> (8 * h)), j, pick_j[h], _CMP_LT_OQ);
                pick_j[h] = _mm512_mask_mov_pd(pick_j[h], better[h], j);
            }
            const __mmask16 bt = (__mmask16)(better[0] | (better[1] << 8));
            pick.inv = vblend(bt, pick.inv, c[i].inv);
            pick.a = vblend(bt, pick.a, c[i].a);
            pick.zp = vblend(bt, pick.zp, c[i].zp);
            pick.lo = vblend(bt, pick.lo, c[i].lo);
            pick.hi = vblend(bt, pick.hi, c[i].hi);
            pick.scale = vblend(bt, pick.scale, cs);
            pick.b = vblend(bt, pick.b, cb);
            found |= bt; /* the plain levels (i = 0) keep their clamp range: c[0].lo, hi */
        }

        /* the exact errors of plain and pick; keep pick if below (1 - 2^-30) times plain's */
        if (found) {
            __m512d ep[2], ek[2];
            _Alignas(64) double xd[AXL_QGROUP_MAX_BLOCK * 16];
            for (int64_t k = 0; k < b; k++)
                for (int h = 0; h < 2; h++)
                    _mm512_store_pd(xd + k * 16 + 8 * h, half_pd(_mm512_load_ps(xt + k * 16), h));
            vmeasure(xt, xd, wt, b, &pl, scheme, weighted,
                     scheme == AXL_Q_SYMMETRIC ? CLAMP_NONE : CLAMP_BOTH, ep);
            vmeasure(xt, xd, wt, b, &pick, scheme, weighted, CLAMP_BOTH, ek);
            const __m512d factor = _mm512_set1_pd(1.0 - 0x1p-30);
            __mmask8 keep[2];
            for (int h = 0; h < 2; h++)
                keep[h] = _mm512_cmp_pd_mask(ek[h], _mm512_mul_pd(ep[h], factor), _CMP_LT_OQ);
            const __mmask16 kp = found & (__mmask16)(keep[0] | (keep[1] << 8));
            const __m512 pv[7] = {pick.inv, pick.a, pick.zp, pick.lo, pick.hi, pick.scale, pick.b};
            for (int i = 0; i < 7; i++) best[i] = vblend(kp, best[i], pv[i]);
        }
    }

    float v[7][16];
    for (int i = 0; i < 7; i++) _mm512_storeu_ps(v[i], best[i]);
    for (int j = 0; j < 16; j++) {
        out[j] = (axl_qcand){v[0][j], v[1][j], v[5][j], v[6][j], (int32_t)v[2][j]};
        lo_out[j] = (int32_t)v[3][j];
        hi_out[j] = (int32_t)v[4][j];
    }
    return 0;
}

AXL_AVX512 int axl_qsearch_group_avx512(const void *w, int src_dtype, const axl_qformat *f,
                                        int64_t g0, axl_qcand c[AXL_QGROUP],
                                        int32_t lo_q[AXL_QGROUP], int32_t hi_q[AXL_QGROUP]) {
    _Alignas(64) float xt[AXL_QGROUP_MAX_BLOCK * 16], wt[AXL_QGROUP_MAX_BLOCK * 16];
    const int64_t b = f->block;
    const int weighted = f->importance != NULL; /* NULL unless searching */
    load_tile(w, src_dtype, g0 * b, b, xt);
    if (weighted) load_tile(f->importance, AXL_F32, g0 * b, b, wt);
#define GROUP(scheme, wtd) group_any(xt, wt, b, f, c, lo_q, hi_q, scheme, wtd)
    switch (f->scheme) {
    case AXL_Q_SYMMETRIC: return weighted ? GROUP(AXL_Q_SYMMETRIC, 1) : GROUP(AXL_Q_SYMMETRIC, 0);
    case AXL_Q_ZERO_POINT: return weighted ? GROUP(AXL_Q_ZERO_POINT, 1) : GROUP(AXL_Q_ZERO_POINT, 0);
    default: return weighted ? GROUP(AXL_Q_OFFSET, 1) : GROUP(AXL_Q_OFFSET, 0);
    }
#undef GROUP
}

#endif /* AXL_X86 */
