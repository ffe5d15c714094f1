/* quant_search.c - the error-minimising search and the offset scheme (autoxla.h, "formats and
 * the error-minimising search"): one scalar set-up and candidate choice per block, which
 * defines the bits, with the ISA's inner loops (axl_qsearch_ops) for the passes over the block.
 * Where an ISA has a group loop (AVX-512: quant_search_avx512.c), full-length blocks of up to
 * AXL_QGROUP_MAX_BLOCK elements go 16 at a time through it instead, one block per vector lane,
 * the same operations in the same order; the ragged last block and leftovers come here.
 * Learnt from the ideas of llama.cpp's make_qx_quants and make_qkx2_quants (candidate inverse
 * scales around the range, a least-squares refit of the levels each gives, the lowest weighted
 * squared error wins); written anew.
 *
 * The candidates of a block, with N = qmax, qmin = -N - 1, R = N - qmin (levels of the grid):
 *   symmetric, m the signed extreme (max(block, 0) if it is >= -min(block, 0), else
 *     min(block, 0)): inv = -t / m for t in {N+1, N+3/4, N+1/2, N+1/4, N, N-1/2} (the extreme
 *     on the negative side, down to qmin, which absmax never uses; the refit scale then is
 *     negative when m > 0) and inv = t / m for t in {N-1/4, N-1/2, N-1};
 *   zero point, [lo, hi] = [min(min, 0), max(max, 0)], c = lo/2 + hi/2: inv = t / (hi - lo)
 *     and zp = clamp(nearbyint(-1/2 - c * inv), qmin, qmax) (the range centred on the grid)
 *     for t in {R, R-1/2, R-1, R-3/2, R-2, R-3};
 *   offset, [lo, hi] = [min, max], c as above: inv = t / (hi - lo), a = c + (1/2) / inv (so
 *     that (x - a) * inv maps [lo, hi] onto t levels centred on the grid), t as above;
 *   and, for every scheme, the plain result's own levels.
 * Each candidate's levels get the least-squares scale (offset: scale and offset) under the
 * importance weights, from float sums, rounded to nearest scale_dtype; the candidate of the
 * lowest predicted error (double, from the sums; the first on ties) is measured exactly
 * against the plain result and kept only if below (1 - 2^-30) times its error (see
 * autoxla.h). */
#include "internal.h"

/* Element k of a row of src_dtype, widened to f32 exactly. */
static inline float load_elem(const void *w, int src_dtype, int64_t k) {
    switch (src_dtype) {
    case AXL_F32: return ((const float *)w)[k];
    case AXL_BF16: return axl_f32_from_bits((uint32_t)((const uint16_t *)w)[k] << 16);
    default: return axl_f32_from_bits(axl_f16_to_f32_bits(((const uint16_t *)w)[k]));
    }
}

static inline int32_t level(float x, const axl_qcand *c, int32_t lo_q, int32_t hi_q) {
    int32_t v = (int32_t)axl_round_small((x - c->a) * c->inv) + c->zp;
    return v < lo_q ? lo_q : v > hi_q ? hi_q : v;
}

static inline float dequant(int32_t v, const axl_qcand *c, int offset) {
    float y = (float)(v - c->zp) * c->scale;
    return offset ? y + c->b : y;
}

/* ---- the reference inner loops ----------------------------------------------------------- */

static void sums_ref(const void *w, int src_dtype, const float *imp, int64_t k0, int64_t k1,
                     const axl_qcand *c, const int32_t *lo_q, const int32_t *hi_q, int n,
                     float out[3][AXL_QCANDS]) {
    for (int i = 0; i < n; i++) {
        float s0 = 0, s1 = 0, s2 = 0;
        for (int64_t k = k0; k < k1; k++) {
            const float x = load_elem(w, src_dtype, k), wt = imp ? imp[k] : 1.0f;
            const float d = (float)(level(x, &c[i], lo_q[i], hi_q[i]) - c[i].zp);
            s0 += (wt * x) * d;
            s1 += wt * (d * d);
            s2 += wt * d;
        }
        out[0][i] = s0;
        out[1][i] = s1;
        out[2][i] = s2;
    }
}

static void error_ref(const void *w, int src_dtype, const float *imp, int64_t k0, int64_t k1,
                      const axl_qcand *c, int32_t lo_q, int32_t hi_q, int offset,
                      double lanes[AXL_QLANES]) {
    for (int64_t k = k0; k < k1; k++) {
        const float x = load_elem(w, src_dtype, k), wt = imp ? imp[k] : 1.0f;
        const double e = (double)x - (double)dequant(level(x, c, lo_q, hi_q), c, offset);
        lanes[(k - k0) % AXL_QLANES] += (double)wt * (e * e);
    }
}

static void range_ref(const void *w, int src_dtype, const float *imp, int64_t k0, int64_t k1,
                      int offset, uint32_t *amax_out, float *mn_out, float *mx_out,
                      float lw[AXL_QLANES], float lx[AXL_QLANES]) {
    uint32_t amax = 0;
    float mn = INFINITY, mx = -INFINITY;
    for (int64_t k = k0; k < k1; k++) {
        float x = load_elem(w, src_dtype, k);
        axl_range_add(x, &amax, &mn, &mx);
        if (offset) {
            const float wt = imp ? imp[k] : 1.0f;
            lw[(k - k0) % AXL_QLANES] += wt;
            lx[(k - k0) % AXL_QLANES] += wt * x;
        }
    }
    *amax_out = amax;
    *mn_out = mn;
    *mx_out = mx;
}

void axl_qsearch_write_ref(const void *w, int src_dtype, int64_t k0, int64_t k1,
                           const axl_qcand *c, int32_t lo_q, int32_t hi_q, int offset, int bits,
                           void *q, double *signal, double *noise, double *max_abs_err) {
    int8_t *q8 = q;
    uint8_t *q4 = q;
    for (int64_t k = k0; k < k1; k++) {
        const float x = load_elem(w, src_dtype, k);
        const int32_t v = level(x, c, lo_q, hi_q);
        if (bits == 8)
            q8[k] = (int8_t)v;
        else if (k & 1)
            q4[k >> 1] |= (uint8_t)((v & 0xF) << 4);
        else
            q4[k >> 1] = (uint8_t)(v & 0xF);
        if (signal) {
            const int64_t l = (k - k0) % AXL_QLANES;
            axl_qstats_add(x, dequant(v, c, offset), &signal[l], &noise[l], max_abs_err);
        }
    }
}

const axl_qsearch_ops axl_qsearch_ref = {sums_ref, error_ref, range_ref, axl_qsearch_write_ref,
                                         NULL};

/* ---- the scalar set-up ------------------------------------------------------------------- */

/* v (finite) rounded to the nearest value of scale_dtype (ties to even), widened back;
 * +-Inf when it overflows fp16. */
static float round_nearest(float v, int scale_dtype) {
    if (scale_dtype == AXL_F32) return v;
    uint32_t b = axl_bits_of_f32(v);
    if (scale_dtype == AXL_BF16) return axl_f32_from_bits((uint32_t)axl_f32_bits_to_bf16(b) << 16);
    return axl_f32_from_bits(axl_f16_to_f32_bits(axl_f32_bits_to_f16(b)));
}

/* The 16 lanes summed as a fixed tree: halves, quarters, eighths, then the last pair. */
static double lane_sum_d(const double *l) {
    double t[8];
    for (int i = 0; i < 8; i++) t[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) t[i] = t[i] + t[i + 4];
    for (int i = 0; i < 2; i++) t[i] = t[i] + t[i + 2];
    return t[0] + t[1];
}

static float lane_sum_f(const float *l) {
    float s = l[0];
    for (int i = 1; i < AXL_QLANES; i++) s += l[i];
    return s;
}

static double measure(const axl_qsearch_ops *ops, const void *w, int src_dtype, const float *imp,
                      int64_t k0, int64_t k1, const axl_qcand *c, int32_t lo_q, int32_t hi_q,
                      int offset) {
    double lanes[AXL_QLANES] = {0};
    ops->error(w, src_dtype, imp, k0, k1, c, lo_q, hi_q, offset, lanes);
    return lane_sum_d(lanes);
}

/* Block g's plain parameters (axl_quantize's, or the offset scheme's min-max ones) in *p, its
 * clamp range in *lo_q, *hi_q; S_w and S_x (the offset refit's constant sums) in sw, sx.
 * Returns 1 if the block makes the row non-finite. */
static int plain_block(const void *w, int src_dtype, const axl_qformat *f, const float *imp,
                       int64_t k0, int64_t k1, const axl_qsearch_ops *ops, axl_qcand *p,
                       int32_t *lo_q, int32_t *hi_q, float *mn_out, float *mx_out, float *sw,
                       float *sx) {
    const int32_t qmax = axl_qmax(f), qmin = -qmax - 1;
    uint32_t amax = 0;
    float mn, mx, lw[AXL_QLANES] = {0}, lx[AXL_QLANES] = {0};
    ops->range(w, src_dtype, imp, k0, k1, f->scheme == AXL_Q_OFFSET, &amax, &mn, &mx, lw, lx);
    if (amax >= 0x7F800000u) return 1;
    /* -0 and +0 as one (a vector min may pick either): nothing below depends on the sign. */
    mn += 0.0f;
    mx += 0.0f;
    *sw = lane_sum_f(lw);
    *sx = lane_sum_f(lx);
    *mn_out = mn;
    *mx_out = mx;
    *p = (axl_qcand){0, 0, 0, 0, 0};
    *lo_q = qmin;
    *hi_q = qmax;
    if (f->scheme == AXL_Q_SYMMETRIC) {
        axl_qparams_sym(axl_f32_from_bits(amax), (float)qmax, f->scale_dtype, &p->scale, &p->inv);
        *lo_q = -qmax;
        return p->scale * (float)qmax == INFINITY;
    }
    if (f->scheme == AXL_Q_ZERO_POINT) {
        float lo = mn < 0 ? mn : 0, hi = mx > 0 ? mx : 0;
        if (axl_qparams_asym(lo, hi, qmin, qmax, f->scale_dtype, &p->scale, &p->inv, &p->zp))
            return 1;
        return p->scale * (float)(qmax - qmin) == INFINITY;
    }
    float s = (mx - mn) / (float)(qmax - qmin);
    if (s == INFINITY) return 1;
    s = axl_scale_round(s, f->scale_dtype);
    float r = s > 0 ? 1.0f / s : INFINITY;
    if (r == INFINITY) s = r = 0; /* a constant (or nearly) block: y = offset */
    if (s * (float)(qmax - qmin) == INFINITY) return 1;
    float b = round_nearest(mn - (float)qmin * s, f->scale_dtype);
    if (b == INFINITY || b == -INFINITY) return 1; /* an fp16 offset beyond 65504 */
    *p = (axl_qcand){r, b, s, b, 0};
    return 0;
}

/* Candidate i (0 .. count-1, then -1 for the plain levels) of a block; see the top. */
enum { SYM_CANDIDATES = 9, RANGE_CANDIDATES = 6 };

static axl_qcand candidate(const axl_qformat *f, int i, const axl_qcand *plain, float mn, float mx) {
    const float n = (float)axl_qmax(f), r = 2 * n + 1;
    axl_qcand c = {0, 0, 0, 0, 0};
    if (i < 0) {
        c = *plain;
        return c;
    }
    if (f->scheme == AXL_Q_SYMMETRIC) {
        static const float t_neg[6] = {1.0f, 0.75f, 0.5f, 0.25f, 0.0f, -0.5f};
        static const float t_pos[3] = {-0.25f, -0.5f, -1.0f};
        float lo = mn < 0 ? mn : 0, hi = mx > 0 ? mx : 0, m = hi >= -lo ? hi : lo;
        c.inv = i < 6 ? -(n + t_neg[i]) / m : (n + t_pos[i - 6]) / m;
        return c;
    }
    static const float t_range[RANGE_CANDIDATES] = {0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f};
    float lo = mn, hi = mx;
    if (f->scheme == AXL_Q_ZERO_POINT) {
        lo = mn < 0 ? mn : 0;
        hi = mx > 0 ? mx : 0;
    }
    const float center = lo * 0.5f + hi * 0.5f;
    c.inv = (r + t_range[i]) / (hi - lo);
    if (f->scheme == AXL_Q_ZERO_POINT) {
        const int32_t qmin = -(int32_t)n - 1, qmax = (int32_t)n;
        /* Clamped as a float, then converted: a range too small for its inv (+-Inf, or a
         * product beyond int32) made the conversion undefined (clang's UBSan); such a
         * candidate is then dropped by its inv in search_block, NaN and -Inf give qmin as
         * before, and every in-range z the same level. */
        const float z = axl_round_small(-0.5f - center * c.inv);
        c.zp = !(z >= (float)qmin) ? qmin : z > (float)qmax ? qmax : (int32_t)z;
    } else {
        c.a = center + 0.5f / c.inv;
    }
    return c;
}

/* The search of one block: *best becomes the winning candidate (else stays the plain one). */
static void search_block(const void *w, int src_dtype, const axl_qformat *f, const float *imp,
                         int64_t k0, int64_t k1, const axl_qsearch_ops *ops, float mn, float mx,
                         float sw, float sx, axl_qcand *best, int32_t *lo_q, int32_t *hi_q) {
    const int offset = f->scheme == AXL_Q_OFFSET;
    const int32_t qmax = axl_qmax(f), qmin = -qmax - 1;
    const int count = f->scheme == AXL_Q_SYMMETRIC ? SYM_CANDIDATES : RANGE_CANDIDATES;
    const axl_qcand plain = *best;
    axl_qcand cands[AXL_QCANDS], pick = plain;
    int32_t lo[AXL_QCANDS], hi[AXL_QCANDS], index[AXL_QCANDS];
    int n = 0;
    for (int i = -1; i < count; i++) {
        axl_qcand c = candidate(f, i, &plain, mn, mx);
        if (!(c.inv == c.inv) || c.inv == INFINITY || c.inv == -INFINITY) continue;
        /* The plain levels keep their own clamp range (symmetric: [-qmax, qmax]). */
        lo[n] = i < 0 ? *lo_q : qmin;
        hi[n] = i < 0 ? *hi_q : qmax;
        index[n] = i;
        cands[n++] = c;
    }
    float sums[3][AXL_QCANDS];
    ops->sums(w, src_dtype, imp, k0, k1, cands, lo, hi, n, sums);
    double pick_j = INFINITY;
    int found = 0;
    for (int i = 0; i < n; i++) {
        axl_qcand c = cands[i];
        const double sxl = sums[0][i], sll = sums[1][i], sl = sums[2][i];
        double scale, off = 0;
        if (offset) {
            const double det = (double)sw * sll - sl * sl;
            if (!(det > 0)) continue;
            scale = ((double)sw * sxl - (double)sx * sl) / det;
            off = (sll * sx - sl * sxl) / det;
        } else {
            if (!(sll > 0)) continue;
            scale = sxl / sll;
        }
        c.scale = round_nearest((float)scale, f->scale_dtype);
        c.b = offset ? round_nearest((float)off, f->scale_dtype) : 0;
        if (!(c.scale - c.scale == 0) || !(c.b - c.b == 0) || c.scale == 0) continue; /* Inf/NaN */
        const double s = c.scale, o = c.b;
        double j = s * s * sll - 2 * s * sxl;
        if (offset) j += 2 * s * o * sl + o * o * sw - 2 * o * sx;
        if (j < pick_j) {
            pick_j = j;
            pick = c;
            found = index[i] < 0 ? 2 : 1;
        }
    }
    if (!found) return;
    const int32_t pl = found == 2 ? *lo_q : qmin, ph = found == 2 ? *hi_q : qmax;
    const double e_plain = measure(ops, w, src_dtype, imp, k0, k1, &plain, *lo_q, *hi_q, offset);
    const double e_pick = measure(ops, w, src_dtype, imp, k0, k1, &pick, pl, ph, offset);
    if (e_pick < e_plain * (1.0 - 0x1p-30)) {
        *best = pick;
        *lo_q = pl;
        *hi_q = ph;
    }
}

int axl_quant_row_search(const void *w, int src_dtype, const axl_qformat *f, void *q,
                         void *scales, int8_t *zp, void *offsets, float *max_err,
                         float *sqnr_db, const axl_qsearch_ops *ops) {
    const int stats = max_err || sqnr_db, offset = f->scheme == AXL_Q_OFFSET;
    double signal[AXL_QLANES] = {0}, noise[AXL_QLANES] = {0}, max_abs_err = 0;
    /* Full-length blocks go AXL_QGROUP at a time where the ISA can (the ragged last block and
     * the leftovers one by one); after a refused group, its blocks one by one. */
    const int grouped = ops->group && f->block <= AXL_QGROUP_MAX_BLOCK;
    const int64_t full = f->cols / f->block;
    int64_t single_until = 0;
    axl_qcand cs[AXL_QGROUP];
    int32_t los[AXL_QGROUP], his[AXL_QGROUP];
    int held = 0; /* candidates of blocks g .. g + held - 1 in cs from the group */
    for (int64_t g = 0; g < f->groups; g++) {
        const int64_t k0 = g * f->block, k1 = axl_block_end(f, g);
        axl_qcand c;
        int32_t lo_q, hi_q;
        if (!held && grouped && g >= single_until && g + AXL_QGROUP <= full) {
            if (ops->group(w, src_dtype, f, g, cs, los, his))
                single_until = g + AXL_QGROUP;
            else
                held = AXL_QGROUP;
        }
        if (held) {
            const int j = AXL_QGROUP - held--;
            c = cs[j];
            lo_q = los[j];
            hi_q = his[j];
        } else {
            float mn, mx, sw, sx;
            if (plain_block(w, src_dtype, f, f->importance, k0, k1, ops, &c, &lo_q, &hi_q, &mn,
                            &mx, &sw, &sx))
                return 1;
            if (f->search && c.scale != 0)
                search_block(w, src_dtype, f, f->importance, k0, k1, ops, mn, mx, sw, sx, &c,
                             &lo_q, &hi_q);
        }
        axl_scale_store(scales, f->scale_dtype, g, c.scale);
        if (zp) zp[g] = (int8_t)c.zp;
        if (offset) axl_scale_store(offsets, f->scale_dtype, g, c.b);
        ops->write(w, src_dtype, k0, k1, &c, lo_q, hi_q, offset, f->bits, q,
                   stats ? signal : NULL, noise, &max_abs_err);
    }
    if (stats) axl_qstats_finish(signal, noise, max_abs_err, max_err, sqnr_db);
    return 0;
}

/* Stores y as element k of a row of dst_dtype, rounded as axl_convert rounds. */
static inline void store_elem(void *out, int dst_dtype, int64_t k, float y) {
    switch (dst_dtype) {
    case AXL_F32: ((float *)out)[k] = y; break;
    case AXL_BF16: ((uint16_t *)out)[k] = axl_f32_bits_to_bf16(axl_bits_of_f32(y)); break;
    default: ((uint16_t *)out)[k] = axl_f32_bits_to_f16(axl_bits_of_f32(y)); break;
    }
}

void axl_dequant_row_offset(const void *q, const void *scales, const void *offsets,
                            const axl_qformat *f, void *out, int dst_dtype) {
    const int8_t *q8 = q;
    const uint8_t *q4 = q;
    for (int64_t g = 0; g < f->groups; g++) {
        const int64_t k0 = g * f->block, k1 = axl_block_end(f, g);
        const float scale = axl_scale_load(scales, f->scale_dtype, g);
        const float b = axl_scale_load(offsets, f->scale_dtype, g);
        for (int64_t k = k0; k < k1; k++) {
            int32_t v = f->bits == 8 ? q8[k] : axl_nibble_value((q4[k >> 1] >> (4 * (k & 1))) & 0xFu);
            store_elem(out, dst_dtype, k, (float)v * scale + b);
        }
    }
}
