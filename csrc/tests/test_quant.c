/* test_quant.c - axl_quantize / axl_dequantize: golden bytes pinning the int4 nibble order
 * and the bf16 rounding of scales, the scalar reference against the documented formulas
 * (values, dequantized values, error statistics, the error bound), every vectorised ISA equal
 * to the reference bit for bit (every source and destination dtype, every format, odd widths,
 * 1/2/3/all threads, with FTZ/DAZ and another rounding mode set by the caller), blocks at
 * the edges of the clamps and of the half-step bound (the one clamp that can bind, binding),
 * zero blocks, subnormals, NaN/Inf rows, thread creation failure, and bad arguments. Every
 * one of these runs with f32 and with bf16 scales. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "test.h"

#if AXL_X86
#include <xmmintrin.h> /* _mm_getcsr / _mm_setcsr */
#endif

#define GUARD 64 /* bytes after every output buffer that must stay untouched */
#define GUARD_BYTE 0xA5

static const int float_dtypes[] = {AXL_F32, AXL_BF16, AXL_F16};
static const char *const dtype_names[] = {"f32", "bf16", "f16"};
/* How scales are stored; the tests written for the first two (goldens, zero and tiny blocks,
 * clamps) loop over those, the ISA comparisons over all three. */
static const int scale_dtypes[] = {AXL_F32, AXL_BF16, AXL_F16};
static const int thread_counts[] = {1, 2, 3, 0};

static uint64_t rng_state = 0x853C49E6748FEA9Bu;
static uint32_t rng_u32(void) { return axl_test_rng(&rng_state); }
static float rng_unit(void) { return (float)(rng_u32() >> 8) * (1.0f / 16777216.0f); }
/* Roughly normal: the sum of four uniforms, centred. */
static float rng_normal(void) {
    return (rng_unit() + rng_unit() + rng_unit() + rng_unit() - 2.0f) * 1.7320508f;
}

static int isa_available(int isa) {
    return axl_convert(NULL, AXL_F32, NULL, AXL_F32, 0, 1, isa) == AXL_OK;
}

/* ---- weights ----------------------------------------------------------------------------- */

/* f32 value -> element i of a buffer of dtype (rounded as axl_convert rounds). */
static void put(void *buf, int dtype, int64_t i, float x) {
    uint32_t b = axl_bits_of_f32(x);
    if (dtype == AXL_F32)
        ((float *)buf)[i] = x;
    else if (dtype == AXL_BF16)
        ((uint16_t *)buf)[i] = axl_f32_bits_to_bf16(b);
    else
        ((uint16_t *)buf)[i] = axl_f32_bits_to_f16(b);
}

/* Element i of a buffer of dtype, widened to f32. */
static float get(const void *buf, int dtype, int64_t i) {
    if (dtype == AXL_F32) return ((const float *)buf)[i];
    uint16_t h = ((const uint16_t *)buf)[i];
    return axl_f32_from_bits(dtype == AXL_BF16 ? (uint32_t)h << 16 : axl_f16_to_f32_bits(h));
}

enum { ROW_KINDS = 11 };

/* Row r of a test weight, by kind r % ROW_KINDS: ordinary values at a per-row magnitude,
 * all zeros, zero blocks among ordinary ones, subnormals of the dtype, exact rounding ties,
 * one sign only, a single outlier, values so small that a scale's reciprocal overflows,
 * and the extremes of the dtype. */
static void fill_row(void *w, int dtype, int64_t r, int64_t cols) {
    const int64_t at = r * cols;
    const int kind = (int)(r % ROW_KINDS);
    const float max_mag = dtype == AXL_F16 ? 6.0e4f : 3.0e38f;
    float mag = powf(10.0f, -3.0f + 6.0f * rng_unit());
    for (int64_t k = 0; k < cols; k++) {
        float x = rng_normal() * mag;
        switch (kind) {
        case 1: x = 0; break;
        case 2: if ((k / 32) % 3 == 1) x = (k & 1) ? -0.0f : 0.0f; break;
        case 3: /* subnormals of the dtype, and its smallest normals */
            if (dtype == AXL_F16)
                x = (float)((int)(rng_u32() % 2047) - 1023) * 5.9604645e-8f; /* k * 2^-24 */
            else
                x = axl_f32_from_bits((rng_u32() & 0x80000000u) |
                                      (rng_u32() & 0x00FFFFFFu) >> (rng_u32() % 8));
            break;
        case 4: x = (float)((int)(rng_u32() % 509) - 254) * 0.5f; break; /* k/2: ties */
        case 5: x = x < 0 ? -x : x; break;
        case 6: x = x > 0 ? -x : x; break;
        case 7: x = k == cols / 2 ? fminf(mag * 1000.0f, max_mag) : x; break; /* an outlier */
        case 8: /* tiny: subnormal scales, and scales whose reciprocal overflows */
            x = rng_normal() * (dtype == AXL_F16 ? 1.0e-7f : powf(10.0f, -39.0f + 4 * rng_unit()));
            break;
        case 9: /* up to the dtype's largest; one sign, so hi - lo cannot overflow */
            x = (r & 1 ? -1.0f : 1.0f) * max_mag * rng_unit();
            break;
        default: break;
        }
        put(w, dtype, at + k, x);
    }
}

static void *make_weight(int dtype, int64_t rows, int64_t cols) {
    void *w = xmalloc((size_t)(rows * cols) * axl_dtype_size(dtype));
    for (int64_t r = 0; r < rows; r++) fill_row(w, dtype, r, cols);
    return w;
}

/* ---- results ----------------------------------------------------------------------------- */

typedef struct qres {
    int64_t rows, cols, groups;
    int bits;
    int scale_dtype;
    size_t q_bytes, scale_size; /* scale_size: bytes per scale */
    unsigned char *q;
    void *scales;
    int8_t *zp;
    float *max_err, *sqnr;
    int64_t bad_row;
} qres;

static void *guarded(size_t bytes) {
    unsigned char *p = xmalloc(bytes + GUARD);
    memset(p, GUARD_BYTE, bytes + GUARD);
    return p;
}

static int guard_intact(const void *p, size_t bytes) {
    const unsigned char *g = (const unsigned char *)p + bytes;
    for (size_t i = 0; i < GUARD; i++)
        if (g[i] != GUARD_BYTE) return 0;
    return 1;
}

/* A guarded buffer of `bytes` that was never written. */
static int untouched(const void *p, size_t bytes) {
    const unsigned char *b = p;
    for (size_t i = 0; i < bytes + GUARD; i++)
        if (b[i] != GUARD_BYTE) return 0;
    return 1;
}

static int64_t q_row_bytes(int64_t cols, int bits) { return bits == 8 ? cols : (cols + 1) / 2; }

static void qres_init(qres *r, int64_t rows, int64_t cols, int bits, int64_t block,
                      int scale_dtype) {
    r->rows = rows;
    r->cols = cols;
    r->bits = bits;
    r->scale_dtype = scale_dtype;
    r->scale_size = axl_dtype_size(scale_dtype);
    r->groups = cols ? (cols - 1) / (block < cols ? block : cols) + 1 : 0;
    r->q_bytes = (size_t)(rows * q_row_bytes(cols, bits));
    r->q = guarded(r->q_bytes);
    r->scales = guarded((size_t)(rows * r->groups) * r->scale_size);
    r->zp = guarded((size_t)(rows * r->groups));
    r->max_err = guarded((size_t)rows * 4);
    r->sqnr = guarded((size_t)rows * 4);
    r->bad_row = -2;
}

static void qres_free(qres *r) {
    free(r->q);
    free(r->scales);
    free(r->zp);
    free(r->max_err);
    free(r->sqnr);
}

static int qres_guards(const qres *r) {
    size_t sg = (size_t)(r->rows * r->groups);
    return guard_intact(r->q, r->q_bytes) && guard_intact(r->scales, sg * r->scale_size) &&
           guard_intact(r->zp, sg) && guard_intact(r->max_err, (size_t)r->rows * 4) &&
           guard_intact(r->sqnr, (size_t)r->rows * 4);
}

static int run_quantize(const void *w, int dt, int symmetric, int64_t block, int stats,
                        qres *r, int nthreads, int isa) {
    return axl_quantize(w, dt, r->rows, r->cols, r->bits, symmetric, block, r->q, r->scales,
                        r->scale_dtype, symmetric ? NULL : r->zp, stats ? r->max_err : NULL,
                        stats ? r->sqnr : NULL, &r->bad_row, nthreads, isa);
}

static int run_dequantize(const qres *r, int symmetric, int64_t block, void *out, int dst_dtype,
                          int nthreads, int isa) {
    return axl_dequantize(r->q, r->scales, r->scale_dtype, symmetric ? NULL : r->zp, r->rows,
                          r->cols, r->bits, block, out, dst_dtype, nthreads, isa);
}

/* Scale i (row * groups + block) of a result, widened to f32. */
static float scale_at(const qres *r, int64_t i) {
    if (r->scale_dtype == AXL_F32) return ((const float *)r->scales)[i];
    uint16_t h = ((const uint16_t *)r->scales)[i];
    if (r->scale_dtype == AXL_BF16) return axl_f32_from_bits((uint32_t)h << 16);
    return axl_f32_from_bits(axl_f16_to_f32_bits(h));
}

/* f32 -> fp16 -> f32, rounded up (toward +Inf), written out independently of the library:
 * the fp16 quantum at x (2^(e - 10) for x in [2^e, 2^(e+1)), e >= -14; 2^-24 below, the
 * subnormals) times ceil(x / quantum), in double (exact); +Inf above 65504. For finite
 * x >= 0 only. */
static float f16_rounded(float x) {
    if (x == 0) return 0;
    int e;
    frexp((double)x, &e); /* x in [2^(e-1), 2^e) */
    double quantum = ldexp(1.0, (e - 1 < -14 ? -14 : e - 1) - 10);
    double r = ceil((double)x / quantum) * quantum;
    return r > 65504.0 ? INFINITY : (float)r;
}

/* The stored scale of an fp32 scale s, by the scale dtype's rule (up, for bf16 and fp16). */
static float rounded_scale(float s, int scale_dtype);

/* f32 -> bf16 -> f32, rounded up (toward +Inf), written out independently of the library:
 * x >= 0 keeps its high 16 bits, plus one bf16 step if any dropped bit is set. For finite
 * x >= 0 only (what a scale is). */
static float bf16_rounded(float x) {
    uint32_t b = axl_bits_of_f32(x), kept = b & 0xFFFF0000u;
    if (b & 0xFFFFu) kept += 0x10000u;
    return axl_f32_from_bits(kept);
}

static float rounded_scale(float s, int scale_dtype) {
    return scale_dtype == AXL_BF16 ? bf16_rounded(s) : scale_dtype == AXL_F16 ? f16_rounded(s) : s;
}

static const char *scale_name(int scale_dtype) {
    return scale_dtype == AXL_F32 ? "f32 scales" : scale_dtype == AXL_BF16 ? "bf16 scales"
                                                                            : "f16 scales";
}

/* Name of the first output that differs ("" if none). */
static const char *qres_diff(const qres *a, const qres *b, int symmetric, int stats) {
    size_t sg = (size_t)(a->rows * a->groups);
    if (memcmp(a->q, b->q, a->q_bytes)) return "q";
    if (memcmp(a->scales, b->scales, sg * a->scale_size)) return "scales";
    if (!symmetric && memcmp(a->zp, b->zp, sg)) return "zero points";
    if (stats && memcmp(a->max_err, b->max_err, (size_t)a->rows * 4)) return "max_err";
    if (stats && memcmp(a->sqnr, b->sqnr, (size_t)a->rows * 4)) return "sqnr_db";
    if (!qres_guards(b)) return "guard bytes";
    return "";
}

/* Stored integer k of row r. */
static int32_t q_at(const qres *r, int64_t row, int64_t k) {
    const unsigned char *p = r->q + row * q_row_bytes(r->cols, r->bits);
    if (r->bits == 8) return (int8_t)p[k];
    return axl_nibble_value((p[k / 2] >> (4 * (k & 1))) & 0xFu);
}

/* ---- the reference against the documented arithmetic ------------------------------------ */

/* Re-derives every output of a scalar run from the formulas in autoxla.h, written out
 * independently, and checks the error bound: half a step of the stored scale (plus fp32
 * rounding), with either scale dtype. Returns the number of failures. */
static int64_t check_formulas(const void *w, int dt, int symmetric, int64_t block,
                              const qres *r, const char *what) {
    const int32_t qmax = r->bits == 8 ? 127 : 7, qmin = symmetric ? -qmax : -qmax - 1;
    int64_t bad = 0;
    for (int64_t row = 0; row < r->rows && bad < 5; row++) {
        double sig[16] = {0}, noi[16] = {0}, emax = 0;
        for (int64_t g = 0; g < r->groups; g++) {
            float lo = 0, hi = 0, amax = 0;
            const int64_t k1 = (g + 1) * block < r->cols ? (g + 1) * block : r->cols;
            for (int64_t k = g * block; k < k1; k++) {
                float x = get(w, dt, row * r->cols + k);
                amax = fabsf(x) > amax ? fabsf(x) : amax;
                lo = x < lo ? x : lo;
                hi = x > hi ? x : hi;
            }
            const float s = symmetric ? amax / (float)qmax : (hi - lo) / (float)(qmax - qmin);
            float scale = rounded_scale(s, r->scale_dtype);
            float inv = scale > 0 ? 1.0f / scale : INFINITY;
            int32_t zp = 0;
            if (isinf(inv)) scale = inv = 0;
            else if (!symmetric) {
                zp = qmin - (int32_t)nearbyintf(lo * inv);
                zp = zp < qmin ? qmin : zp > qmax ? qmax : zp;
            }
            float got_scale = scale_at(r, row * r->groups + g);
            int32_t got_zp = symmetric ? 0 : r->zp[row * r->groups + g];
            if (memcmp(&got_scale, &scale, 4) || got_zp != zp) {
                CHECK_MSG(0, "%s row %lld block %lld: scale %a zp %d, want %a zp %d", what,
                          (long long)row, (long long)g, got_scale, got_zp, scale, zp);
                bad++;
                continue;
            }
            for (int64_t k = g * block; k < k1; k++) {
                float x = get(w, dt, row * r->cols + k);
                int32_t v = (int32_t)nearbyintf(x * inv) + zp;
                v = v < qmin ? qmin : v > qmax ? qmax : v;
                int32_t got = q_at(r, row, k);
                float dq = (float)(v - zp) * scale;
                /* Half a step, plus the scale's and the product's fp32 rounding (about
                 * 2^-15 of a step, see test_quantize.py), plus 2^-149 for subnormal
                 * products; with a bf16 scale too (it rounds up, so the block's range fits
                 * its grid). A zero block (s <= 2^-128, with either scale dtype) holds only
                 * values below 255 * 2^-128 (1 + 2^-22) < 2^-120. */
                double err = fabs((double)x - (double)dq);
                double bound = scale > 0 ? scale * (0.5 + 1.0 / 8192) + 0x1p-149 : 0x1p-120;
                if (got != v || err > bound) {
                    CHECK_MSG(0, "%s row %lld col %lld: x %a q %d want %d, |x - dq| %g > %g",
                              what, (long long)row, (long long)k, x, got, v, err, bound);
                    bad++;
                    break;
                }
                double e = (double)x - (double)dq;
                /* What lets the vector kernels fuse each product with its sum (FMA) and still
                 * give these bits: e is x - dq exactly (TwoSum's error term is 0), and e * e
                 * and x * x are exact doubles (fma's residual is 0). */
                double xp = e + (double)dq, dp = e - xp;
                if (((double)x - xp) + (-(double)dq - dp) != 0 || fma(e, e, -(e * e)) != 0 ||
                    fma((double)x, (double)x, -((double)x * (double)x)) != 0) {
                    CHECK_MSG(0, "%s row %lld col %lld: x %a dq %a: x - dq or a square inexact",
                              what, (long long)row, (long long)k, x, dq);
                    bad++;
                    break;
                }
                sig[(k - g * block) % 16] += (double)x * (double)x; /* lane: position */
                noi[(k - g * block) % 16] += e * e;                 /* within the block */
                emax = fabs(e) > emax ? fabs(e) : emax;
            }
        }
        double s = sig[0], n = noi[0];
        for (int l = 1; l < 16; l++) {
            s += sig[l];
            n += noi[l];
        }
        float want_sqnr = n == 0 ? INFINITY : (float)(10 * log10(s / n));
        float want_max = (float)emax;
        if (memcmp(&want_max, &r->max_err[row], 4) || memcmp(&want_sqnr, &r->sqnr[row], 4)) {
            CHECK_MSG(0, "%s row %lld: max_err %a sqnr %a, want %a %a", what, (long long)row,
                      r->max_err[row], r->sqnr[row], want_max, want_sqnr);
            bad++;
        }
    }
    return bad;
}

/* Dequantizes with the reference and checks against (float)(q - zp) * scale converted by
 * axl_convert's scalar kernel. */
static void check_dequant_formula(const qres *r, int symmetric, int64_t block, int dd,
                                  const void *out, const char *what) {
    size_t ds = axl_dtype_size(dd);
    int64_t n = r->rows * r->cols;
    float *y = xmalloc((size_t)n * 4);
    void *want = xmalloc((size_t)n * ds);
    for (int64_t row = 0; row < r->rows; row++)
        for (int64_t k = 0; k < r->cols; k++) {
            int64_t g = row * r->groups + k / block;
            int32_t zp = symmetric ? 0 : r->zp[g];
            y[row * r->cols + k] = (float)(q_at(r, row, k) - zp) * scale_at(r, g);
        }
    CHECK_EQ(axl_convert(y, AXL_F32, want, dd, n, 1, AXL_ISA_SCALAR), AXL_OK);
    CHECK_MSG(memcmp(want, out, (size_t)n * ds) == 0, "%s: dequantized values differ", what);
    free(y);
    free(want);
}

/* ---- every ISA against the reference ----------------------------------------------------- */

/* Block sizes of a width: per-channel, the multiples of 32 dividing it up to 1024, and
 * ragged ones (a short last block): 32 and 64 when they do not divide it, an odd size, and
 * one above cols (one block per row). */
static int block_sizes(int64_t cols, int64_t *out) {
    int n = 0;
    out[n++] = cols;
    for (int64_t b = 32; b <= 1024 && b < cols; b += 32)
        if (cols % b == 0) out[n++] = b;
    if (cols > 32 && cols % 32) out[n++] = 32;
    if (cols > 64 && cols % 64) out[n++] = 64;
    if (cols > 13) out[n++] = 13;
    out[n++] = cols + 5;
    return n;
}

typedef struct case_opts {
    int formulas;    /* check the reference against the formulas */
    int all_threads; /* 1, 2, 3, 0 threads too */
} case_opts;

/* One weight and format: the reference, then every ISA (with and without statistics);
 * dequantized back to every dtype by every ISA. */
/* w with every row whose largest |x| is at least 2^16 scaled down by a power of two (exact)
 * to below 2^16: fp16 scales then stay below 65504 (an fp16 overflow refuses the row; that
 * is test_f16_scales' to check). NULL when no row needs it. */
static void *tamed_for_f16(const void *w, int dt, int64_t rows, int64_t cols) {
    void *copy = NULL;
    for (int64_t r = 0; r < rows; r++) {
        float m = 0;
        for (int64_t k = 0; k < cols; k++) m = fmaxf(m, fabsf(get(w, dt, r * cols + k)));
        if (m < 65536.0f) continue;
        if (!copy) {
            copy = xmalloc((size_t)(rows * cols) * axl_dtype_size(dt));
            memcpy(copy, w, (size_t)(rows * cols) * axl_dtype_size(dt));
        }
        int e;
        frexpf(m, &e);
        for (int64_t k = 0; k < cols; k++)
            put(copy, dt, r * cols + k, ldexpf(get(w, dt, r * cols + k), 16 - e));
    }
    return copy;
}

static void check_format(const void *w, int dt, int64_t rows, int64_t cols, int bits,
                         int symmetric, int64_t block, int scale_dtype, case_opts opts) {
    void *tamed = scale_dtype == AXL_F16 ? tamed_for_f16(w, dt, rows, cols) : NULL;
    if (tamed) w = tamed;
    size_t n = (size_t)(rows * cols);
    char what[192];
    snprintf(what, sizeof what, "%s %lldx%lld int%d %s block %lld %s", dtype_names[dt],
             (long long)rows, (long long)cols, bits, symmetric ? "sym" : "asym", (long long)block,
             scale_name(scale_dtype));
    qres want;
    qres_init(&want, rows, cols, bits, block, scale_dtype);
    int status = run_quantize(w, dt, symmetric, block, 1, &want, 1, AXL_ISA_SCALAR);
    CHECK_MSG(status == AXL_OK && want.bad_row == -1, "%s: status %d bad_row %lld", what, status,
              (long long)want.bad_row);
    CHECK_MSG(qres_guards(&want), "%s: reference wrote past a buffer", what);
    if (opts.formulas) check_formulas(w, dt, symmetric, block, &want, what);
    void *want_out[3], *got_out = xmalloc(n * 4 + GUARD);
    for (int d = 0; d < 3; d++) {
        want_out[d] = xmalloc(n * axl_dtype_size(d));
        CHECK_EQ(run_dequantize(&want, symmetric, block, want_out[d], d, 1, AXL_ISA_SCALAR),
                 AXL_OK);
        if (opts.formulas) check_dequant_formula(&want, symmetric, block, d, want_out[d], what);
    }
    for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
        if (!isa_available(isa)) continue;
        for (size_t t = 0; t < (opts.all_threads ? 4u : 1u); t++)
            for (int stats = 0; stats <= 1; stats++) {
                int nt = thread_counts[t];
                qres got;
                qres_init(&got, rows, cols, bits, block, scale_dtype);
                status = run_quantize(w, dt, symmetric, block, stats, &got, nt, isa);
                const char *diff = qres_diff(&want, &got, symmetric, stats);
                CHECK_MSG(status == AXL_OK && got.bad_row == -1 && !*diff,
                          "%s isa %s nthreads %d stats %d: status %d, %s differ", what,
                          axl_isa_name(isa), nt, stats, status, diff);
                if (!stats) /* no statistics asked: none written */
                    CHECK(untouched(got.max_err, (size_t)rows * 4) &&
                          untouched(got.sqnr, (size_t)rows * 4));
                qres_free(&got);
            }
        for (int d = 0; d < 3; d++)
            for (size_t t = 0; t < (opts.all_threads ? 4u : 1u); t++) {
                size_t bytes = n * axl_dtype_size(d);
                memset(got_out, GUARD_BYTE, bytes + GUARD);
                status = run_dequantize(&want, symmetric, block, got_out, d, thread_counts[t], isa);
                CHECK_MSG(status == AXL_OK && memcmp(got_out, want_out[d], bytes) == 0 &&
                              guard_intact(got_out, bytes),
                          "%s dequantize -> %s isa %s nthreads %d: status %d", what,
                          dtype_names[d], axl_isa_name(isa), thread_counts[t], status);
            }
    }
    for (int d = 0; d < 3; d++) free(want_out[d]);
    free(got_out);
    qres_free(&want);
    free(tamed);
}

/* One weight: check_format for every format, block size and scale dtype. */
static void check_weight(const void *w, int dt, int64_t rows, int64_t cols, case_opts opts) {
    int64_t blocks[64];
    int nblocks = block_sizes(cols, blocks);
    for (int sd = 0; sd < 3; sd++)
        for (int bits = 4; bits <= 8; bits += 4)
            for (int symmetric = 0; symmetric <= 1; symmetric++)
                for (int bi = 0; bi < nblocks; bi++)
                    check_format(w, dt, rows, cols, bits, symmetric, blocks[bi], scale_dtypes[sd],
                                 opts);
}

static void test_isas_match_reference(void) {
    const int64_t widths[] = {1, 7, 16, 32, 77, 96, 333, 1024, 2048};
    const case_opts opts = {1, 0};
    for (size_t c = 0; c < sizeof widths / sizeof *widths; c++)
        for (int a = 0; a < 3; a++) {
            int64_t cols = widths[c];
            /* Enough rows for every row kind; fewer for the widest. */
            int64_t rows = cols >= 1024 ? ROW_KINDS + 1 : ROW_KINDS * 2 + 1 + (int64_t)(rng_u32() % 5);
            void *w = make_weight(float_dtypes[a], rows, cols);
            check_weight(w, float_dtypes[a], rows, cols, opts);
            free(w);
        }
}

/* Ragged blocks (a short last block per row) and odd block sizes, where int4 blocks start
 * half-way into a byte: every width 1..97 with odd blocks, and 200 in blocks of 32. */
static void test_ragged_blocks(void) {
    const case_opts opts = {1, 0};
    const int64_t blocks[] = {1, 3, 5, 7, 17, 31, 33, 48};
    for (int64_t cols = 1; cols <= 97; cols++) {
        const int dt = float_dtypes[cols % 3];
        const int64_t rows = 3 + cols % 4;
        void *w = make_weight(dt, rows, cols);
        for (size_t b = 0; b < sizeof blocks / sizeof *blocks; b++) {
            if (blocks[b] >= cols && b > 0 && blocks[b - 1] >= cols) break; /* one per row */
            for (int sd = 0; sd < 3; sd++)
                for (int bits = 4; bits <= 8; bits += 4)
                    for (int symmetric = 0; symmetric <= 1; symmetric++)
                        check_format(w, dt, rows, cols, bits, symmetric, blocks[b],
                                     scale_dtypes[sd], opts);
        }
        free(w);
    }
    for (int a = 0; a < 3; a++) {
        void *w = make_weight(float_dtypes[a], ROW_KINDS * 2 + 1, 200);
        for (int sd = 0; sd < 3; sd++)
            for (int bits = 4; bits <= 8; bits += 4)
                for (int symmetric = 0; symmetric <= 1; symmetric++)
                    check_format(w, float_dtypes[a], ROW_KINDS * 2 + 1, 200, bits, symmetric, 32,
                                 scale_dtypes[sd], opts);
        free(w);
    }
}

/* Large enough for several threads (2^16 elements each), with odd widths. */
static void test_threads(void) {
    const case_opts opts = {0, 1};
    const int64_t shapes[][2] = {{300, 1000}, {41, 4096}, {1000, 333}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int dt = float_dtypes[s % 3];
        void *w = make_weight(dt, shapes[s][0], shapes[s][1]);
        check_weight(w, dt, shapes[s][0], shapes[s][1], opts);
        free(w);
    }
}

/* Outputs of at least AXL_STREAM_MIN_BYTES are written with non-temporal stores where a
 * row is aligned: same bytes as the reference, also from a misaligned q. */
static void test_large_outputs(void) {
    const int64_t rows = 520, cols = 4096;
    const struct {
        int bits, symmetric;
        int64_t block;
    } formats[] = {{8, 1, 4096}, {4, 0, 64}, {8, 0, 128}, {4, 1, 32}};
    void *w = make_weight(AXL_BF16, rows, cols);
    for (size_t fs = 0; fs < 2 * sizeof formats / sizeof *formats; fs++) {
        const size_t f = fs / 2;
        const int sd = scale_dtypes[fs % 2];
        int bits = formats[f].bits, symmetric = formats[f].symmetric;
        int64_t block = formats[f].block;
        CHECK(rows * q_row_bytes(cols, bits) >= AXL_STREAM_MIN_BYTES);
        qres want;
        qres_init(&want, rows, cols, bits, block, sd);
        CHECK_EQ(run_quantize(w, AXL_BF16, symmetric, block, 1, &want, 1, AXL_ISA_SCALAR), AXL_OK);
        for (int isa = AXL_ISA_AVX2; isa < AXL_ISA_COUNT; isa++) {
            if (!isa_available(isa)) continue;
            for (int offset = 0; offset <= 1; offset++)
                for (int stats = 0; stats <= 1; stats++) {
                    qres got;
                    qres_init(&got, rows, cols, bits, block, sd);
                    unsigned char *base = got.q;
                    got.q = guarded(got.q_bytes + 1); /* q at an odd address when offset 1 */
                    free(base);
                    base = got.q;
                    got.q += offset;
                    int status = run_quantize(w, AXL_BF16, symmetric, block, stats, &got, 0, isa);
                    const char *diff = qres_diff(&want, &got, symmetric, stats);
                    CHECK_MSG(status == AXL_OK && !*diff,
                              "int%d %s block %lld %s isa %s q offset %d stats %d: %s differ",
                              bits, symmetric ? "sym" : "asym", (long long)block, scale_name(sd),
                              axl_isa_name(isa), offset, stats, diff);
                    got.q = base;
                    qres_free(&got);
                }
        }
        qres_free(&want);
    }
    free(w);
}

/* The caller's FTZ/DAZ and rounding mode change nothing, and are restored. */
static void test_fp_environment(void) {
#if AXL_X86
    const int64_t rows = 40 * ROW_KINDS, cols = 320; /* 140k elements: 2 threads */
    for (int a = 0; a < 3; a++) {
        int dt = float_dtypes[a];
        void *w = make_weight(dt, rows, cols);
        for (int fs = 0; fs < 4; fs++) {
            const int symmetric = fs & 1, sd = scale_dtypes[fs >> 1];
            qres want;
            qres_init(&want, rows, cols, 8, 32, sd);
            CHECK_EQ(run_quantize(w, dt, symmetric, 32, 1, &want, 1, AXL_ISA_SCALAR), AXL_OK);
            const unsigned int modes[] = {0x8040u, 0x4000u | 0x8040u, 0x2000u, 0x6000u};
            for (size_t m = 0; m < sizeof modes / sizeof *modes; m++)
                for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
                    if (!isa_available(isa)) continue;
                    qres got;
                    qres_init(&got, rows, cols, 8, 32, sd);
                    unsigned int csr = _mm_getcsr();
                    unsigned int set = (csr & ~0xE040u) | modes[m];
                    _mm_setcsr(set);
                    int status = run_quantize(w, dt, symmetric, 32, 1, &got, 2, isa);
                    unsigned int after = _mm_getcsr();
                    _mm_setcsr(csr);
                    const char *diff = qres_diff(&want, &got, symmetric, 1);
                    CHECK_MSG(status == AXL_OK && !*diff, "%s %s MXCSR 0x%x isa %s: %s differ",
                              dtype_names[dt], scale_name(sd), set, axl_isa_name(isa), diff);
                    CHECK_MSG((after & ~0x3Fu) == (set & ~0x3Fu), "MXCSR 0x%x not restored: 0x%x",
                              set, after);
                    qres_free(&got);
                }
            qres_free(&want);
        }
        free(w);
    }
#endif
}

/* ---- golden bytes --------------------------------------------------------------------------- */

typedef struct golden {
    int bits, symmetric;
    int scale_dtypes; /* bit 0: holds with f32 scales, bit 1: with bf16 scales */
    int64_t cols;
    float w[8];
    unsigned char q[8];
    float scale; /* as stored (a bf16 one widened) */
    int8_t zp;
} golden;

enum { WITH_F32 = 1, WITH_BF16 = 2, WITH_BOTH = 3 };

static const golden goldens[] = {
    /* Scales 1 and 2 are bf16 values: the same bytes with either scale dtype. */
    /* int4 symmetric, 5 values: amax 7, scale 1; 3.5 is a tie and rounds to even 4.
     * q = 7, -7, 1, -1, 4: bytes (lo | hi << 4) 0x97, 0xF1, and 0x04 with a 0 padding nibble. */
    {4, 1, WITH_BOTH, 5, {7, -7, 1, -1, 3.5f}, {0x97, 0xF1, 0x04}, 1.0f, 0},
    /* int4 asymmetric: lo -3, hi 12, scale 15/15 = 1, zp = -8 - (-3) = -5.
     * q = -8, 7, -5, rint(2.5) - 5 = -3, 7 - 5 = 2: bytes 0x78, 0xDB, 0x02. */
    {4, 0, WITH_BOTH, 5, {-3, 12, 0, 2.5f, 7}, {0x78, 0xDB, 0x02}, 1.0f, -5},
    /* int4 symmetric, 6 values: 0.5 and -0.5 are ties to even 0; -1.5 -> -2 (even). */
    {4, 1, WITH_BOTH, 6, {0.5f, -0.5f, -1.5f, 7, 2.5f, -7}, {0x00, 0x7E, 0x92}, 1.0f, 0},
    /* int8 asymmetric: lo -1, hi 254, scale 1, zp -127: -1 -> -128, 254 -> 127, 0 -> -127. */
    {8, 0, WITH_BOTH, 3, {-1, 254, 0}, {0x80, 0x7F, 0x81}, 1.0f, -127},
    /* int8 symmetric: amax 254, scale 2; 3 -> 1.5 -> 2, 5 -> 2.5 -> 2, -254 -> -127. */
    {8, 1, WITH_BOTH, 3, {3, 5, -254}, {0x02, 0x02, 0x81}, 2.0f, 0},

    /* The bf16 rounding of scales, up (computed by hand with numpy float32 ops):
     * int8 symmetric, amax 100: s = 100/127 = 0x3F4992A5 rounds up to bf16 0x3F4A =
     * 0.7890625; inv = 1.2673268. 50 * inv = 63.37 -> 63, where the f32 scale gives
     * 50 * 1.27 = 63.5 -> 64; -37.5 -> -47.52 -> -48. */
    {8, 1, WITH_F32, 5, {100, -37.5f, 0.4f, 63, 50}, {0x7F, 0xD0, 0x01, 0x50, 0x40},
     100.0f / 127.0f, 0},
    {8, 1, WITH_BF16, 5, {100, -37.5f, 0.4f, 63, 50}, {0x7F, 0xD0, 0x01, 0x50, 0x3F},
     0.7890625f, 0},
    /* int8 asymmetric, lo = -255.7470703125 = -255 (1 + 3 * 2^-10), hi 0: s = 1 + 3 * 2^-10
     * (0x3F806000) rounds UP to bf16 0x3F81 = 1.0078125 (to nearest it would be 1.0, and
     * both clamps would bind), inv = 0x1.fc07f0p-1 = 0.99224806: lo * inv = -253.76 -> -254,
     * zp = -128 + 254 = 126, lo -> -128; 0 -> 126; -50.6 -> -50.21 -> -50 + 126 = 76;
     * -0.625 -> -0.62 -> -1 + 126 = 125; -100.5 -> -99.72 -> -100 + 126 = 26. With the f32
     * scale: zp 127, -50.6 * 0.99708 -> -50 -> 77. */
    {8, 0, WITH_F32, 5, {-255.7470703125f, 0, -50.6f, -0.625f, -100.5f},
     {0x80, 0x7F, 0x4D, 0x7E, 0x1B}, 1.0029296875f, 127},
    {8, 0, WITH_BF16, 5, {-255.7470703125f, 0, -50.6f, -0.625f, -100.5f},
     {0x80, 0x7E, 0x4C, 0x7D, 0x1A}, 1.0078125f, 126},
    /* int8 symmetric with a subnormal bf16 scale: amax = 132 * 2^-128, s = 33.26 * 2^-133
     * (0x1.0a1428p-128) rounds up to 34 * 2^-133 = 0x1.1p-128 (bf16 bits 0x0022), so
     * amax * inv = 132 * 32 / 34 = 124.24 -> 124, -amax -> -124; 66 * 2^-128 -> 62.12 -> 62;
     * -33 * 2^-128 -> -31.06 -> -31. With the f32 scale: 127, -127, 64, -32. */
    {8, 1, WITH_F32, 4, {0x1.08p-121f, -0x1.08p-121f, 0x1.08p-122f, -0x1.08p-123f},
     {0x7F, 0x81, 0x40, 0xE0}, 0x1.08p-121f / 127.0f, 0},
    {8, 1, WITH_BF16, 4, {0x1.08p-121f, -0x1.08p-121f, 0x1.08p-122f, -0x1.08p-123f},
     {0x7C, 0x84, 0x3E, 0xE1}, 0x1.1p-128f, 0},
    /* int4 symmetric: s = 7.1 / 7 = 1.0142857 (0x3F81D41D) rounds up to bf16 1.015625
     * (0x3F82): 7.1 -> 6.99 -> 7, -3.3 -> -3.25 -> -3, 1.4 -> 1.38 -> 1. */
    {4, 1, WITH_BF16, 3, {7.1f, -3.3f, 1.4f}, {0xD7, 0x01}, 1.015625f, 0},
    /* int4 symmetric: s = 7.0000005 / 7 = 1 + 2^-23 (the lowest dropped bit alone) rounds
     * up to 1.0078125 (0x3F81): 7.0000005 -> 6.95 -> 7, 3.5 -> 3.47 -> 3 (not the tie of a
     * scale of 1, which goes to 4). */
    {4, 1, WITH_BF16, 2, {7.0000005f, 3.5f}, {0x37}, 1.0078125f, 0},
};

/* Stored integer k of a golden's q. */
static int32_t golden_value(const golden *g, int64_t k) {
    if (g->bits == 8) return (int8_t)g->q[k];
    return axl_nibble_value((g->q[k / 2] >> (4 * (k & 1))) & 0xFu);
}

/* Each golden as it is (per-channel, cols elements), and padded with zeros to one block of
 * 32 (zeros change neither amax nor lo and hi; they quantize to the zero point), which
 * takes the AVX-512 kernel's unmasked path. With every scale dtype it holds for. */
static void test_goldens(void) {
    for (size_t i = 0; i < sizeof goldens / sizeof *goldens; i++) {
        const golden *g = &goldens[i];
        for (int sd = 0; sd < 2; sd++) {
            if (!(g->scale_dtypes & (1 << sd))) continue;
            const int scale_dtype = scale_dtypes[sd];
            for (int padded = 0; padded <= 1; padded++) {
                const int64_t cols = padded ? 32 : g->cols;
                float w[32] = {0};
                memcpy(w, g->w, (size_t)g->cols * sizeof *w);
                int32_t want[32];
                for (int64_t k = 0; k < cols; k++)
                    want[k] = k < g->cols ? golden_value(g, k) : g->zp;
                for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
                    if (!isa_available(isa)) continue;
                    qres r;
                    qres_init(&r, 1, cols, g->bits, cols, scale_dtype);
                    memset(r.zp, 99, 1);
                    int status = run_quantize(w, AXL_F32, g->symmetric, cols, 0, &r, 1, isa);
                    CHECK_MSG(status == AXL_OK && r.bad_row == -1,
                              "golden %zu %s isa %s: status %d", i, scale_name(scale_dtype),
                              axl_isa_name(isa), status);
                    for (int64_t k = 0; k < cols; k++)
                        CHECK_MSG(q_at(&r, 0, k) == want[k],
                                  "golden %zu %s padded %d isa %s element %lld: %d, want %d", i,
                                  scale_name(scale_dtype), padded, axl_isa_name(isa),
                                  (long long)k, q_at(&r, 0, k), want[k]);
                    if (g->bits == 4 && (cols & 1)) /* the padding nibble */
                        CHECK_MSG(r.q[cols / 2] >> 4 == 0, "golden %zu: padding nibble", i);
                    CHECK_MSG(qres_guards(&r), "golden %zu: wrote past a buffer", i);
                    float got_scale = scale_at(&r, 0);
                    int32_t got_zp = g->symmetric ? 0 : r.zp[0];
                    CHECK_MSG(memcmp(&got_scale, &g->scale, 4) == 0 && got_zp == g->zp,
                              "golden %zu %s isa %s: scale %a zp %d, want %a %d", i,
                              scale_name(scale_dtype), axl_isa_name(isa), got_scale, got_zp,
                              g->scale, g->zp);
                    float back[32];
                    CHECK_EQ(run_dequantize(&r, g->symmetric, cols, back, AXL_F32, 1, isa), AXL_OK);
                    for (int64_t k = 0; k < cols; k++)
                        CHECK_MSG(back[k] == (float)(want[k] - g->zp) * g->scale,
                                  "golden %zu: element %lld back %g", i, (long long)k, back[k]);
                    qres_free(&r);
                }
            }
        }
    }
    /* Two blocks of 32 of int4: the nibble order holds across the block boundary. Scales 1
     * and 10 are bf16 values. */
    float w[64];
    for (int k = 0; k < 64; k++) w[k] = k < 32 ? (float)(k % 15 - 7) : (float)(k % 15 - 7) * 10;
    for (int sd = 0; sd < 2; sd++) {
        qres r;
        qres_init(&r, 1, 64, 4, 32, scale_dtypes[sd]);
        CHECK_EQ(run_quantize(w, AXL_F32, 1, 32, 0, &r, 1, AXL_ISA_AUTO), AXL_OK);
        CHECK(scale_at(&r, 0) == 1.0f && scale_at(&r, 1) == 10.0f);
        for (int j = 0; j < 32; j++) {
            int lo = (2 * j) % 15 - 7, hi = (2 * j + 1) % 15 - 7;
            CHECK_MSG(r.q[j] == (unsigned char)((lo & 0xF) | (hi & 0xF) << 4), "byte %d: 0x%02x",
                      j, r.q[j]);
        }
        qres_free(&r);
    }
}

/* ---- clamps and the half-step bound at a block's ends ----------------------------------------
 * A bf16 scale rounds up, so the clamps that quant_avx512.c leaves out cannot bind with
 * either scale dtype, and no element ends up more than half a step (of the stored scale,
 * plus fp32 rounding) from its dequantized value. Blocks are searched at random, by the
 * formulas of autoxla.h written out here: ranges of every size, one-sign blocks (lo = 0 or
 * hi = 0, where a scale rounded down would cost most), tiny ranges whose scales are
 * subnormal (bf16 subnormals from 2^-128 (1 + 2^-5) up), and blocks built so that the one
 * clamp that can bind (asymmetric, above qmax: both ends are ties rounding away) does. Every
 * block's ends must stay within the bound, only that clamp may bind and it must be found;
 * then every ISA must equal the reference on the blocks kept (check_formulas checks the
 * bound on every element), in every kernel layout. */

enum { ABOVE = 1, BELOW = 2, ZP_CLAMPED = 4, SUBNORMAL_SCALE = 8, ONE_SIGN = 16, BOUND = 32 };

/* What the unclamped values of a block with range [lo, hi] (lo <= 0 <= hi; symmetric:
 * lo = -hi) reach: ABOVE (nearbyint(x * inv) + zp > qmax for x = hi), BELOW (< qmin for
 * x = lo), ZP_CLAMPED, SUBNORMAL_SCALE (a kept scale below 2^-126), ONE_SIGN (lo or hi is 0),
 * and BOUND if lo or hi ends up more than scale (1/2 + 2^-13) + 2^-149 from its dequantized
 * value. 0 for a zero block. */
static int clamp_hits(float lo, float hi, int bits, int symmetric, int scale_dtype) {
    const int32_t qmax = bits == 8 ? 127 : 7, qmin = symmetric ? -qmax : -qmax - 1;
    const float s = symmetric ? hi / (float)qmax : (hi - lo) / (float)(qmax - qmin);
    const float scale = rounded_scale(s, scale_dtype);
    const float inv = scale > 0 ? 1.0f / scale : INFINITY;
    if (isinf(inv)) return 0;
    int32_t zp = 0, hits = scale < 0x1p-126f ? SUBNORMAL_SCALE : 0;
    if (!symmetric && (lo == 0 || hi == 0)) hits |= ONE_SIGN;
    if (!symmetric) {
        zp = qmin - (int32_t)nearbyintf(lo * inv);
        if (zp > qmax) {
            zp = qmax;
            hits |= ZP_CLAMPED;
        }
    }
    const float ends[2] = {lo, hi};
    for (int e = 0; e < 2; e++) {
        int32_t v = (int32_t)nearbyintf(ends[e] * inv) + zp;
        if (v > qmax) hits |= ABOVE;
        if (v < qmin) hits |= BELOW;
        v = v < qmin ? qmin : v > qmax ? qmax : v;
        const float dq = (float)(v - zp) * scale;
        if (fabs((double)ends[e] - (double)dq) > scale * (0.5 + 1.0 / 8192) + 0x1p-149)
            hits |= BOUND;
    }
    return hits;
}

/* A random value of magnitude 2^e for e uniform in [e0, e1), rounded to dtype. */
static float random_magnitude(int dtype, float e0, float e1) {
    float x = exp2f(e0 + (e1 - e0) * rng_unit());
    float buf[1];
    put(buf, dtype, 0, x);
    return get(buf, dtype, 0);
}

#define WITNESSES 4

typedef struct witness_set {
    int n;
    float lo[WITNESSES * 8], hi[WITNESSES * 8];
} witness_set;

/* Fills a (rows, cols) weight of dtype whose row r holds, in each of its blocks of `block`,
 * witness (r + block index) % n: its lo and hi (at elements 0, 1 and every 7th), the rest
 * uniform in [lo, hi] (rounding to the dtype stays within: lo and hi are dtype values). */
static void *witness_weight(const witness_set *ws, int dtype, int64_t rows, int64_t cols,
                            int64_t block) {
    void *w = xmalloc((size_t)(rows * cols) * axl_dtype_size(dtype));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < cols; k++) {
            int i = (int)((r + k / block) % ws->n);
            float lo = ws->lo[i], hi = ws->hi[i], x;
            int64_t j = k % block;
            if (j == 0 || j % 7 == 2)
                x = hi;
            else if (j == 1 || j % 7 == 3)
                x = lo;
            else
                x = lo + (hi - lo) * rng_unit();
            put(w, dtype, r * cols + k, x);
        }
    return w;
}

/* An asymmetric block whose scale is exactly the power of two 2^e (a bf16 value, so it is
 * not rounded) and whose ends are ties that both round away from the middle: lo * inv =
 * -(L + 1/2) with L odd, hi * inv = qmax - qmin - L - 1/2. Then zp = qmin + L + 1 and hi
 * lands on qmax + 1: the upper clamp binds, and hi is exactly half a step from qmax's value.
 * Returns 0 if lo or hi is not a value of dtype. */
static int tie_block(int dtype, int bits, float *lo, float *hi) {
    const int32_t span = bits == 8 ? 255 : 15;
    const int L = 2 * (int)(rng_u32() % (uint64_t)(span / 2)) + 1; /* odd, 1 .. span - 2 */
    const float step = exp2f((float)(int)(rng_u32() % 16) - 10);
    float buf[2];
    *lo = -((float)L + 0.5f) * step;
    *hi = ((float)(span - L) - 0.5f) * step;
    put(buf, dtype, 0, *lo);
    put(buf, dtype, 1, *hi);
    return get(buf, dtype, 0) == *lo && get(buf, dtype, 1) == *hi;
}

static void test_clamps_bind(void) {
    /* Kernel layouts: per-channel rows of 32 and 64 (the AVX-512 kernel's fixed block sizes),
     * 96 (its general one), 40 (its masked kernel, AVX2's scalar tail), and blocks of 32 and
     * 96 in rows of 192. */
    const int64_t layouts[][2] = {{32, 32}, {64, 64}, {96, 96}, {40, 40}, {192, 32}, {192, 96}};
    for (int a = 0; a < 3; a++) {
        const int dt = float_dtypes[a];
        for (int f = 0; f < 8; f++) {
            const int bits = f & 1 ? 4 : 8, symmetric = (f >> 1) & 1, sd = scale_dtypes[f >> 2];
            /* Search: random block ranges; a few blocks of each kind are kept. */
            witness_set ws = {0};
            int seen = 0, counts[64] = {0}, ties = 0;
            for (int t = 0; t < 40000; t++) {
                float lo, hi;
                const int tiny = t % 4 == 1 && dt != AXL_F16; /* f16 has no such tiny values */
                if (!symmetric && t % 4 == 3) {
                    if (!tie_block(dt, bits, &lo, &hi)) continue;
                    ties++;
                } else if (symmetric) {
                    const float e0 = bits == 8 ? -123 : -126; /* s around 2^-128 */
                    hi = tiny ? random_magnitude(dt, e0, e0 + 6)
                              : dt == AXL_F16 ? random_magnitude(dt, -14, 15)
                                              : random_magnitude(dt, -30, 30);
                    lo = -hi;
                } else {
                    const float e0 = tiny ? -127 : -1, e1 = tiny ? -117 : 2;
                    lo = t % 3 == 1 ? 0 : -random_magnitude(dt, e0, e1);
                    hi = t % 3 == 2 ? 0 : random_magnitude(dt, e0, e1);
                }
                int h = clamp_hits(lo, hi, bits, symmetric, sd);
                seen |= h;
                CHECK_MSG(!(h & BOUND), "%s int%d %s %s: block [%a, %a]: an end is more than "
                          "half a step from its value", dtype_names[dt], bits,
                          symmetric ? "sym" : "asym", scale_name(sd), lo, hi);
                /* Keep a few blocks of each kind. */
                if (h && ++counts[h & 63] <= WITNESSES && ws.n < WITNESSES * 8) {
                    ws.lo[ws.n] = lo;
                    ws.hi[ws.n] = hi;
                    ws.n++;
                }
            }
            /* What the proof in quant_avx512.c allows, and what must be found. */
            const int may = symmetric ? 0 : ABOVE, must = may;
            const int found = seen & (ABOVE | BELOW | ZP_CLAMPED);
            CHECK_MSG((found & ~may) == 0 && (found & must) == must && (symmetric || ties > 10),
                      "%s int%d %s %s: clamps binding 0x%x, allowed 0x%x, required 0x%x "
                      "(%d tie blocks)", dtype_names[dt], bits, symmetric ? "sym" : "asym",
                      scale_name(sd), found, may, must, ties);
            /* The search reached one-sign blocks and (but with f16) subnormal scales. */
            const int kinds = (symmetric ? 0 : ONE_SIGN) | (dt == AXL_F16 ? 0 : SUBNORMAL_SCALE);
            CHECK_MSG((seen & kinds) == kinds, "%s int%d %s %s: kinds 0x%x, want 0x%x",
                      dtype_names[dt], bits, symmetric ? "sym" : "asym", scale_name(sd), seen,
                      kinds);
            if (!ws.n) continue;
            /* Every ISA equals the reference on them, with both scale dtypes. */
            for (size_t l = 0; l < sizeof layouts / sizeof *layouts; l++) {
                const int64_t cols = layouts[l][0], block = layouts[l][1], rows = 2 * ws.n + 1;
                void *w = witness_weight(&ws, dt, rows, cols, block);
                const case_opts opts = {1, 0};
                check_format(w, dt, rows, cols, bits, symmetric, block, AXL_F32, opts);
                check_format(w, dt, rows, cols, bits, symmetric, block, AXL_BF16, opts);
                check_format(w, dt, rows, cols, bits, symmetric, block, AXL_F16, opts);
                free(w);
            }
        }
    }
}

/* ---- special rows -------------------------------------------------------------------------- */

/* All-zero rows and blocks: q 0, scale 0, zero point 0, error 0, SQNR +Inf; subnormal
 * rows: exact scales, and every ISA agrees (covered by the reference checks above too). */
static void test_zero_and_tiny(void) {
    const int64_t rows = 4, cols = 64;
    float w[4 * 64];
    memset(w, 0, sizeof w);
    for (int k = 32; k < 64; k++) w[2 * 64 + k] = (float)k; /* row 2: zero block then values */
    for (int k = 0; k < 64; k++) w[3 * 64 + k] = 1e-45f * (float)(k % 3); /* 0 and 2^-149 *k */
    for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
        if (!isa_available(isa)) continue;
        for (int f = 0; f < 8; f++) {
            const int bits = f & 1 ? 4 : 8, symmetric = (f >> 1) & 1, sd = scale_dtypes[f >> 2];
            qres r;
            qres_init(&r, rows, cols, bits, 32, sd);
            CHECK_EQ(run_quantize(w, AXL_F32, symmetric, 32, 1, &r, 1, isa), AXL_OK);
            const int64_t qb = q_row_bytes(cols, bits);
            for (int row = 0; row < 4; row++) {
                /* Rows 0, 1 and 3 are all zero blocks, row 2's first block is. */
                int64_t nonzero = 0, nq = row == 2 ? qb / 2 : qb;
                for (int64_t b = 0; b < nq; b++) nonzero += r.q[row * qb + b] != 0;
                const float s[2] = {scale_at(&r, row * 2), scale_at(&r, row * 2 + 1)};
                CHECK_MSG(nonzero == 0 && s[0] == 0 && !signbit(s[0]) &&
                              (row == 2 ? s[1] > 0 : s[1] == 0 && !signbit(s[1])),
                          "row %d isa %s int%d sym %d %s: %lld non-zero bytes, scales %g %g",
                          row, axl_isa_name(isa), bits, symmetric, scale_name(sd),
                          (long long)nonzero, s[0], s[1]);
                if (!symmetric) CHECK(r.zp[row * 2] == 0 && (row == 2 || r.zp[row * 2 + 1] == 0));
            }
            CHECK(r.max_err[0] == 0 && r.max_err[1] == 0);
            CHECK(isinf(r.sqnr[0]) && r.sqnr[0] > 0 && isinf(r.sqnr[1]) && r.sqnr[1] > 0);
            /* Row 2's zero block is exact: the row's error comes from the other block. */
            CHECK(r.max_err[2] <= 0.5f * scale_at(&r, 5) * 1.001f && r.sqnr[2] > 20);
            /* Row 3 (0, 2^-149, 2^-148): its scales underflow, so it becomes zeros; the
             * error is the signal: 0 dB. */
            CHECK_MSG(r.max_err[3] == 0x1p-148f && r.sqnr[3] == 0.0f, "row 3: %a %g",
                      r.max_err[3], r.sqnr[3]);
            qres_free(&r);
        }
    }
    /* signal 0 < noise cannot happen (a zero block is exact); a row of 2^-149 values with
     * int4 symmetric: scale 2^-149 / 7 underflows to 0, the row becomes zeros, SQNR 0 dB.
     * Then int8 symmetric at the edge of the zero blocks, which is s <= 2^-128 with either
     * scale dtype (a bf16 scale rounds up, to at least 2^-128 (1 + 2^-5) if s > 2^-128):
     *   amax = 127 * 2^-128: s = 2^-128, whose reciprocal 2^128 overflows: zeros.
     *   amax = 127 * 2^-128 + 2^-142: s = 2^-128 + 2^-149 (1/s is finite), which rounds up
     *     to the bf16 33 * 2^-133: q = amax * inv = 123.15 -> 123 (f32: 127).
     *   amax = 16383 * 2^-135: s = 129 * 2^-135, rounds up to the bf16 33 * 2^-133:
     *     q = 16383 / 132 = 124.11 -> 124 (f32: 127).
     * A kept block's error stays within half a step of its stored scale. */
    float tiny[32];
    const struct {
        float amax, f32_scale, bf16_scale;
        int32_t f32_q, bf16_q;
    } tinies[] = {
        {0x1p-149f, 0, 0, 0, 0},
        {0x1.fcp-122f, 0, 0, 0, 0},
        {0x1.fc001p-122f, 0x1.000008p-128f, 0x1.08p-128f, 127, 123},
        {0x1.fff8p-122f, 0x1.02p-128f, 0x1.08p-128f, 127, 124},
    };
    for (size_t a = 0; a < sizeof tinies / sizeof *tinies; a++)
        for (int sd = 0; sd < 2; sd++) {
            for (int k = 0; k < 32; k++) tiny[k] = k % 2 ? -tinies[a].amax : tinies[a].amax;
            for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
                if (!isa_available(isa)) continue;
                qres r;
                qres_init(&r, 1, 32, a == 0 ? 4 : 8, 32, scale_dtypes[sd]);
                CHECK_EQ(run_quantize(tiny, AXL_F32, 1, 32, 1, &r, 1, isa), AXL_OK);
                const float s = sd ? tinies[a].bf16_scale : tinies[a].f32_scale;
                const int32_t want_q = sd ? tinies[a].bf16_q : tinies[a].f32_q;
                const int ok =
                    s == 0 ? scale_at(&r, 0) == 0 && r.max_err[0] == tinies[a].amax &&
                                 r.sqnr[0] == 0.0f
                           : scale_at(&r, 0) == s && q_at(&r, 0, 0) == want_q &&
                                 q_at(&r, 0, 1) == -want_q &&
                                 r.max_err[0] <= s * (0.5 + 1.0 / 8192) &&
                                 r.max_err[0] == fabsf(tinies[a].amax - (float)want_q * s);
                CHECK_MSG(ok, "tiny %zu %s isa %s: scale %a q %d, max_err %a, sqnr %g", a,
                          scale_name(scale_dtypes[sd]), axl_isa_name(isa), scale_at(&r, 0),
                          q_at(&r, 0, 0), r.max_err[0], r.sqnr[0]);
                qres_free(&r);
            }
        }
}

/* NaN and Inf rows: AXL_ERR_NON_FINITE and the lowest such row, for every thread count,
 * ISA and format; also a NaN in a row's scalar tail and an asymmetric range overflow. */
static void test_non_finite(void) {
    const int64_t rows = 200, cols = 1000; /* 200k elements: up to 3 threads; 1000 % 16 = 8 */
    const float nan = NAN;
    for (int a = 0; a < 3; a++) {
        int dt = float_dtypes[a];
        void *w = xmalloc((size_t)(rows * cols) * axl_dtype_size(dt));
        for (int64_t i = 0; i < rows * cols; i++) put(w, dt, i, rng_normal());
        typedef struct {
            int64_t row, col;
            float value;
        } poison;
        const poison cases[][3] = {
            {{37, 999, nan}, {150, 0, INFINITY}, {190, 500, -INFINITY}},
            {{150, 999, -INFINITY}, {199, 3, nan}, {-1, 0, 0}},
            {{0, 0, nan}, {-1, 0, 0}, {-1, 0, 0}},
            {{199, 998, nan}, {-1, 0, 0}, {-1, 0, 0}},
        };
        const int64_t want_rows[] = {37, 150, 0, 199};
        for (size_t c = 0; c < 4; c++) {
            void *p = xmalloc((size_t)(rows * cols) * axl_dtype_size(dt));
            memcpy(p, w, (size_t)(rows * cols) * axl_dtype_size(dt));
            for (int i = 0; i < 3; i++)
                if (cases[c][i].row >= 0)
                    put(p, dt, cases[c][i].row * cols + cases[c][i].col, cases[c][i].value);
            for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
                if (!isa_available(isa)) continue;
                for (size_t t = 0; t < 4; t++)
                    for (int f = 0; f < 8; f++) {
                        /* per-channel; statistics with int4 */
                        int bits = f & 1 ? 4 : 8, symmetric = (f >> 1) & 1;
                        int sd = scale_dtypes[f >> 2];
                        qres r;
                        qres_init(&r, rows, cols, bits, cols, sd);
                        int status =
                            run_quantize(p, dt, symmetric, cols, f & 1, &r, thread_counts[t], isa);
                        CHECK_MSG(status == AXL_ERR_NON_FINITE && r.bad_row == want_rows[c],
                                  "%s case %zu isa %s nthreads %d int%d sym %d %s: status %d "
                                  "row %lld",
                                  dtype_names[dt], c, axl_isa_name(isa), thread_counts[t], bits,
                                  symmetric, scale_name(sd), status, (long long)r.bad_row);
                        qres_free(&r);
                    }
            }
            free(p);
        }
        free(w);
    }
    for (int sd = 0; sd < 2; sd++) {
        const int scale_dtype = scale_dtypes[sd];
        /* Blocks of 32: the NaN in the second block of a row; bad_row may be NULL. */
        float w[4 * 64] = {0};
        w[2 * 64 + 40] = NAN;
        unsigned char q[4 * 64];
        float scales[8];
        int8_t zp[8];
        CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 0, 32, q, scales, scale_dtype, zp, NULL, NULL,
                              NULL, 2, 0),
                 AXL_ERR_NON_FINITE);
        /* Asymmetric range overflow: finite values whose max - min exceeds FLT_MAX (checked
         * on the f32 scale, before any rounding to bf16). */
        w[2 * 64 + 40] = 3e38f;
        w[2 * 64 + 41] = -3e38f;
        for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
            if (!isa_available(isa)) continue;
            int64_t bad = -7;
            CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 0, 32, q, scales, scale_dtype, zp, NULL,
                                  NULL, &bad, 1, isa),
                     AXL_ERR_NON_FINITE);
            CHECK_EQ(bad, 2);
            CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 1, 32, q, scales, scale_dtype, NULL, NULL,
                                  NULL, &bad, 1, isa),
                     AXL_OK);
            CHECK_EQ(bad, -1);
        }
    }
}

/* A symmetric call with a zero-point buffer fills it with zeros. */
static void test_symmetric_zero_points(void) {
    float w[2 * 64];
    for (int k = 0; k < 128; k++) w[k] = (float)(k - 60);
    for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
        if (!isa_available(isa)) continue;
        for (int sd = 0; sd < 2; sd++) {
            int8_t q[128], zp[4];
            float scales[4];
            memset(zp, 0x55, sizeof zp);
            CHECK_EQ(axl_quantize(w, AXL_F32, 2, 64, 8, 1, 32, q, scales, scale_dtypes[sd], zp,
                                  NULL, NULL, NULL, 1, isa),
                     AXL_OK);
            CHECK(zp[0] == 0 && zp[1] == 0 && zp[2] == 0 && zp[3] == 0);
        }
    }
}

/* ---- threads that cannot be created ------------------------------------------------------- */

static void test_thread_failure(void) {
    const int64_t rows = 256, cols = 2048;
    void *w = make_weight(AXL_BF16, rows, cols);
    float *out = xmalloc((size_t)(rows * cols) * 4);
    for (int sd = 0; sd < 2; sd++) {
        qres r;
        qres_init(&r, rows, cols, 4, 64, scale_dtypes[sd]);
        for (int ok_creates = 0; ok_creates < 2; ok_creates++) {
            axl_test_fail_thread_creates(ok_creates);
            CHECK_EQ(run_quantize(w, AXL_BF16, 0, 64, 1, &r, 4, AXL_ISA_AUTO), AXL_ERR_RESOURCE);
            axl_test_fail_thread_creates(ok_creates);
            CHECK_EQ(run_dequantize(&r, 0, 64, out, AXL_F32, 4, AXL_ISA_AUTO), AXL_ERR_RESOURCE);
        }
        axl_test_fail_thread_creates(-1);
        CHECK_EQ(run_quantize(w, AXL_BF16, 0, 64, 1, &r, 4, AXL_ISA_AUTO), AXL_OK);
        CHECK_EQ(run_dequantize(&r, 0, 64, out, AXL_F32, 4, AXL_ISA_AUTO), AXL_OK);
        qres_free(&r);
    }
    free(out);
    free(w);
}

/* fp16 scales: rounded up (golden bits), 2^-24 for any tiny block, 0 for a zero block, and a
 * row whose scale exceeds 65504 refused (bad_row) on every ISA; 65504 itself is kept. */
static void test_f16_scales(void) {
    const int64_t rows = 4, cols = 64;
    float w[4 * 64];
    for (int fmt = 0; fmt < 4; fmt++) {
        const int bits = fmt & 1 ? 8 : 4, symmetric = fmt >> 1;
        const float levels = symmetric ? (bits == 8 ? 127.0f : 7.0f) : (bits == 8 ? 255.0f : 15.0f);
        for (int64_t k = 0; k < rows * cols; k++) w[k] = 0;
        /* row 0, block 0: s = 1.0014.. (between the fp16 values 1 + 2^-10 and 1 + 2^-9) */
        for (int64_t k = 0; k < 32; k++) w[k] = (k & 1 ? 1.0014286f : 0.25f) * levels;
        /* row 0, block 1: tiny, s far below 2^-24 */
        for (int64_t k = 32; k < 64; k++) w[k] = k & 1 ? 1e-30f : -3e-31f;
        /* row 1: s = 65504 exactly, the largest fp16 */
        for (int64_t k = 0; k < 64; k++) w[cols + k] = k == 5 ? 65504.0f * levels : 1.0f;
        /* row 2: block 0 zero; row 3: s just above 65504 */
        for (int64_t k = 32; k < 64; k++) w[2 * cols + k] = 1.0f;
        for (int64_t k = 0; k < 64; k++) w[3 * cols + k] = k == 40 ? 65505.0f * levels : 1.0f;
        for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
            if (!isa_available(isa)) continue;
            qres r;
            qres_init(&r, rows, cols, bits, 32, AXL_F16);
            int status = run_quantize(w, AXL_F32, symmetric, 32, 1, &r, 1, isa);
            CHECK_MSG(status == AXL_ERR_NON_FINITE && r.bad_row == 3,
                      "int%d sym %d isa %s: status %d bad_row %lld", bits, symmetric,
                      axl_isa_name(isa), status, (long long)r.bad_row);
            qres_free(&r);
            qres_init(&r, 3, cols, bits, 32, AXL_F16);
            status = run_quantize(w, AXL_F32, symmetric, 32, 1, &r, 1, isa);
            const uint16_t *h = (const uint16_t *)r.scales;
            CHECK_MSG(status == AXL_OK && h[0] == 0x3C02 && h[1] == 0x0001 && h[2] == 0x7BFF &&
                          h[4] == 0,
                      "int%d sym %d isa %s: status %d, scales 0x%04x 0x%04x 0x%04x 0x%04x",
                      bits, symmetric, axl_isa_name(isa), status, h[0], h[1], h[2], h[4]);
            qres_free(&r);
        }
    }
}

/* ---- the search and the offset scheme (axl_quantize_spec) -------------------------------- */

typedef struct sres {
    unsigned char *q, *scales, *offsets;
    int8_t *zp;
    float *max_err, *sqnr;
    int64_t bad_row;
} sres;

static void sres_init(sres *r, int64_t rows, int64_t cols, int bits, int64_t groups, int sd) {
    r->q = guarded((size_t)(rows * q_row_bytes(cols, bits)));
    r->scales = guarded((size_t)(rows * groups) * axl_dtype_size(sd));
    r->offsets = guarded((size_t)(rows * groups) * axl_dtype_size(sd));
    r->zp = guarded((size_t)(rows * groups));
    r->max_err = guarded((size_t)rows * 4);
    r->sqnr = guarded((size_t)rows * 4);
    r->bad_row = -2;
}

static void sres_free(sres *r) {
    free(r->q);
    free(r->scales);
    free(r->offsets);
    free(r->zp);
    free(r->max_err);
    free(r->sqnr);
}

static int run_spec(const void *w, int dt, int64_t rows, int64_t cols, const axl_qspec *spec,
                    sres *r, int nthreads, int isa) {
    return axl_quantize_spec(w, dt, rows, cols, spec, r->q, r->scales,
                             spec->scheme == AXL_Q_ZERO_POINT ? r->zp : NULL,
                             spec->scheme == AXL_Q_OFFSET ? r->offsets : NULL, r->max_err, r->sqnr,
                             &r->bad_row, nthreads, isa);
}

/* The dequantized row-major matrix (f32) of a result, from the formulas of autoxla.h. */
static void dequant_formula(const sres *r, const axl_qspec *spec, int64_t rows, int64_t cols,
                            int64_t groups, int64_t block, float *y) {
    qres view = {.rows = rows, .cols = cols, .bits = spec->bits, .q = r->q};
    for (int64_t row = 0; row < rows; row++)
        for (int64_t k = 0; k < cols; k++) {
            int64_t g = row * groups + k / block;
            qres sv = {.scale_dtype = spec->scale_dtype, .scales = r->scales};
            float scale = scale_at(&sv, g);
            int32_t v = q_at(&view, row, k);
            if (spec->scheme == AXL_Q_OFFSET) {
                qres ov = {.scale_dtype = spec->scale_dtype, .scales = r->offsets};
                y[row * cols + k] = (float)v * scale + scale_at(&ov, g);
            } else {
                int32_t zp = spec->scheme == AXL_Q_ZERO_POINT ? r->zp[g] : 0;
                y[row * cols + k] = (float)(v - zp) * scale;
            }
        }
}

/* Every ISA and thread count equal to the scalar search bit for bit, with and without
 * importance; per block the searched weighted squared error (double) never above the plain
 * one's; axl_dequantize_spec equal to the formula on every ISA. */
static void check_search_case(const void *w, int dt, int64_t rows, int64_t cols, int bits,
                              int scheme, int64_t block, int sd, const float *imp) {
    const int64_t eb = block < cols ? block : cols, groups = (cols - 1) / eb + 1;
    char what[160];
    snprintf(what, sizeof what, "%s %lldx%lld int%d scheme %d block %lld %s imp %d",
             dtype_names[dt], (long long)rows, (long long)cols, bits, scheme, (long long)block,
             scale_name(sd), imp != NULL);
    axl_qspec plain_spec = {bits, scheme, block, sd, 0, NULL}, spec = {bits, scheme, block, sd, 1, imp};
    sres plain, want;
    sres_init(&plain, rows, cols, bits, groups, sd);
    sres_init(&want, rows, cols, bits, groups, sd);
    int st = run_spec(w, dt, rows, cols, &plain_spec, &plain, 1, AXL_ISA_SCALAR);
    int st2 = run_spec(w, dt, rows, cols, &spec, &want, 1, AXL_ISA_SCALAR);
    CHECK_MSG(st == AXL_OK && st2 == AXL_OK, "%s: status %d / %d", what, st, st2);
    if (st != AXL_OK || st2 != AXL_OK) goto done;
    float *yp = xmalloc((size_t)(rows * cols) * 4), *ys = xmalloc((size_t)(rows * cols) * 4);
    dequant_formula(&plain, &plain_spec, rows, cols, groups, eb, yp);
    dequant_formula(&want, &spec, rows, cols, groups, eb, ys);
    int64_t worse = 0, better = 0;
    for (int64_t row = 0; row < rows; row++)
        for (int64_t g = 0; g < groups; g++) {
            double ep = 0, es = 0;
            for (int64_t k = g * eb; k < cols && k < (g + 1) * eb; k++) {
                double x = get(w, dt, row * cols + k), wt = imp ? imp[k] : 1.0;
                ep += wt * (x - yp[row * cols + k]) * (x - yp[row * cols + k]);
                es += wt * (x - ys[row * cols + k]) * (x - ys[row * cols + k]);
            }
            worse += es > ep * (1 + 1e-12); /* summation order only (see autoxla.h) */
            better += es < ep;
        }
    CHECK_MSG(worse == 0, "%s: %lld blocks worse than plain", what, (long long)worse);
    if (scheme == AXL_Q_OFFSET && bits == 4 && cols >= 32 && rows > 4)
        CHECK_MSG(better > 0, "%s: the search never helped", what);
    size_t qb = (size_t)(rows * q_row_bytes(cols, bits)), sb = (size_t)(rows * groups) * axl_dtype_size(sd);
    for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
        if (!isa_available(isa)) continue;
        for (int t = 0; t < 2; t++) {
            sres got;
            sres_init(&got, rows, cols, bits, groups, sd);
            st = run_spec(w, dt, rows, cols, &spec, &got, t ? 3 : 1, isa);
            int same = st == AXL_OK && !memcmp(got.q, want.q, qb) && !memcmp(got.scales, want.scales, sb) &&
                       (scheme != AXL_Q_ZERO_POINT || !memcmp(got.zp, want.zp, (size_t)(rows * groups))) &&
                       (scheme != AXL_Q_OFFSET || !memcmp(got.offsets, want.offsets, sb)) &&
                       !memcmp(got.max_err, want.max_err, (size_t)rows * 4) &&
                       !memcmp(got.sqnr, want.sqnr, (size_t)rows * 4) && guard_intact(got.q, qb) &&
                       guard_intact(got.scales, sb) && guard_intact(got.offsets, sb);
            CHECK_MSG(same, "%s isa %s threads %d: status %d, differs from scalar", what,
                      axl_isa_name(isa), t ? 3 : 1, st);
            sres_free(&got);
        }
        for (int d = 0; d < 3; d++) {
            size_t n = (size_t)(rows * cols), ds = axl_dtype_size(d);
            void *want_out = xmalloc(n * ds), *out = xmalloc(n * ds);
            CHECK_EQ(axl_convert(ys, AXL_F32, want_out, d, (int64_t)n, 1, AXL_ISA_SCALAR), AXL_OK);
            st = axl_dequantize_spec(want.q, want.scales, scheme == AXL_Q_ZERO_POINT ? want.zp : NULL,
                                     want.offsets, rows, cols, &spec, out, d, 2, isa);
            CHECK_MSG(st == AXL_OK && !memcmp(out, want_out, n * ds), "%s dequantize -> %s isa %s",
                      what, dtype_names[d], axl_isa_name(isa));
            free(want_out);
            free(out);
        }
    }
    free(yp);
    free(ys);
done:
    sres_free(&plain);
    sres_free(&want);
}

/* Heavy tails (every 37th element 9x: outliers in most blocks) make the search matter. */
static void test_search(void) {
    const int64_t shapes[][3] = {{ROW_KINDS * 2 + 1, 64, 32}, {13, 200, 32}, {7, 77, 10}, {9, 96, 96},
                                 {5, 33, 7}, {300, 512, 64}};
    for (size_t c = 0; c < sizeof shapes / sizeof *shapes; c++) {
        const int64_t rows = shapes[c][0], cols = shapes[c][1], block = shapes[c][2];
        const int dt = float_dtypes[c % 3];
        void *w = make_weight(dt, rows, cols);
        for (int64_t i = 0; i < rows * cols; i += 37)
            if (fabsf(get(w, dt, i)) < 1e3f) put(w, dt, i, get(w, dt, i) * 9.0f);
        void *tamed = tamed_for_f16(w, dt, rows, cols);
        float *imp = xmalloc((size_t)cols * 4);
        for (int64_t k = 0; k < cols; k++) imp[k] = k % 5 == 0 ? 0.0f : rng_unit() * 4.0f;
        for (int sd = 0; sd < 3; sd++)
            for (int bits = 4; bits <= 8; bits += 4)
                for (int scheme = 0; scheme < AXL_Q_SCHEME_COUNT; scheme++)
                    for (int wi = 0; wi < 2; wi++)
                        check_search_case(sd == 2 && tamed ? tamed : w, dt, rows, cols, bits,
                                          scheme, block, scale_dtypes[sd], wi ? imp : NULL);
        free(imp);
        free(tamed);
        free(w);
    }
}

/* ---- the search 16 blocks at a time (axl_qsearch_ops.group) ----------------------------- */

/* Rows for the grouped search: the ROW_KINDS kinds, rows whose blocks each take another kind
 * (so a group's lanes differ: zero, tiny, one-sign, extreme blocks side by side), a NaN and an
 * Inf in a middle block (the row refused), and blocks whose plain scale is just below fp16's
 * largest for int4 and for int8 (refits past it are Inf; with fp16 scales the other width
 * refuses the row). */
static void *make_group_weight(int dt, int64_t rows, int64_t cols, int64_t block) {
    void *w = make_weight(dt, rows, cols), *kinds = make_weight(dt, ROW_KINDS, cols);
    const size_t es = axl_dtype_size(dt);
    for (int64_t r = ROW_KINDS; r < rows; r++) {
        const int64_t at = r * cols;
        for (int64_t k = 0; k < cols; k++) {
            const int64_t kind = (k / block + r) % ROW_KINDS;
            memcpy((char *)w + (size_t)(at + k) * es, (char *)kinds + (size_t)(kind * cols + k) * es, es);
        }
        const int64_t mid = (cols / block / 2) * block + block / 3;
        switch (r % 6) {
        case 0: if (mid < cols) put(w, dt, at + mid, NAN); break;
        case 1: if (mid < cols) put(w, dt, at + mid, -INFINITY); break;
        case 2: /* fall through */
        case 3:
            if (dt == AXL_F16) break; /* beyond fp16 itself */
            for (int64_t k = 0; k < cols; k++)
                if (k % block == (r + k / block) % block)
                    put(w, dt, at + k, (k & 1 ? -1.0f : 1.0f) * 65000.0f * (r % 6 == 2 ? 7.0f : 127.0f));
            break;
        default: break;
        }
    }
    free(kinds);
    return w;
}

/* Every vectorised ISA (1 and 3 threads) gives the scalar search's status, bad row and bytes;
 * with one thread also on a refused row (the blocks before its bad one are written), after
 * which the rows past it are checked in a call of their own. */
static void check_group_case(const void *w, int dt, int64_t rows, int64_t cols, int bits,
                             int scheme, int64_t block, int sd, const float *imp) {
    const int64_t groups = (cols - 1) / block + 1;
    const axl_qspec spec = {bits, scheme, block, sd, 1, imp};
    for (int64_t r0 = 0; r0 < rows;) {
        const int64_t n = rows - r0;
        const void *wr = (const char *)w + (size_t)(r0 * cols) * axl_dtype_size(dt);
        const size_t qb = (size_t)(n * q_row_bytes(cols, bits)), sb = (size_t)(n * groups) * axl_dtype_size(sd);
        const size_t zb = scheme == AXL_Q_ZERO_POINT ? (size_t)(n * groups) : 0;
        const size_t ob = scheme == AXL_Q_OFFSET ? sb : 0;
        sres want;
        sres_init(&want, n, cols, bits, groups, sd);
        const int st = run_spec(wr, dt, n, cols, &spec, &want, 1, AXL_ISA_SCALAR);
        CHECK(st == AXL_OK || st == AXL_ERR_NON_FINITE);
        for (int isa = AXL_ISA_SCALAR + 1; isa < AXL_ISA_COUNT; isa++) {
            if (!isa_available(isa)) continue;
            for (int t = 1; t <= 3; t += 2) {
                sres got;
                sres_init(&got, n, cols, bits, groups, sd);
                const int gst = run_spec(wr, dt, n, cols, &spec, &got, t, isa);
                const int all = st == AXL_OK || t == 1; /* 3 threads may go on past a bad row */
                const int same =
                    gst == st && got.bad_row == want.bad_row &&
                    (!all || (!memcmp(got.q, want.q, qb) && !memcmp(got.scales, want.scales, sb) &&
                              !memcmp(got.zp, want.zp, zb) && !memcmp(got.offsets, want.offsets, ob) &&
                              !memcmp(got.max_err, want.max_err, (size_t)n * 4) &&
                              !memcmp(got.sqnr, want.sqnr, (size_t)n * 4))) &&
                    guard_intact(got.q, qb) && guard_intact(got.scales, sb) && guard_intact(got.offsets, sb);
                CHECK_MSG(same, "grouped search %s %lldx%lld (from row %lld) block %lld int%d scheme %d "
                          "%s imp %d isa %s threads %d: status %d/%d bad_row %lld/%lld, differs from scalar",
                          dtype_names[dt], (long long)rows, (long long)cols, (long long)r0, (long long)block,
                          bits, scheme, scale_name(sd), imp != NULL, axl_isa_name(isa), t, gst, st,
                          (long long)got.bad_row, (long long)want.bad_row);
                sres_free(&got);
            }
        }
        r0 = st == AXL_OK ? rows : r0 + want.bad_row + 1;
        sres_free(&want);
    }
}

/* 1 to 40 blocks of 32 (groups of 16 with leftovers, some rows with a ragged last block), and
 * other block lengths (16, 20 and 7: no 16x16 transposes; 256: the largest grouped; 257: not
 * grouped), every scheme, width and scale dtype; source dtype and importance by turns. */
static void test_search_groups(void) {
    const int64_t rows = ROW_KINDS + 12;
    const int64_t extra[][2] = {{16, 17}, {20, 16}, {7, 33}, {64, 16}, {256, 16}, {257, 16}};
    const int ncases = 40 + (int)(sizeof extra / sizeof *extra);
    for (int c = 0; c < ncases; c++) {
        const int64_t block = c < 40 ? 32 : extra[c - 40][0];
        const int64_t nb = c < 40 ? c + 1 : extra[c - 40][1];
        const int64_t cols = nb * block + (c % 3 == 2 ? 5 : 0);
        const int dt = float_dtypes[c % 3];
        void *w = make_group_weight(dt, rows, cols, block);
        float *imp = NULL;
        if ((c / 3) % 2) {
            imp = xmalloc((size_t)cols * 4);
            for (int64_t k = 0; k < cols; k++) imp[k] = k % 7 == 0 ? 0.0f : rng_unit() * 4.0f;
        }
        for (int sd = 0; sd < 3; sd++)
            for (int bits = 4; bits <= 8; bits += 4)
                for (int scheme = 0; scheme < AXL_Q_SCHEME_COUNT; scheme++)
                    check_group_case(w, dt, rows, cols, bits, scheme, block, scale_dtypes[sd], imp);
        free(imp);
        free(w);
    }
}

/* ---- bad arguments ------------------------------------------------------------------------- */

static void test_bad_arguments(int sd) {
    _Alignas(64) float w[4 * 64] = {0}, scales[16], stats[8], out[4 * 64];
    _Alignas(64) int8_t q[4 * 64], zp[16];
    _Alignas(8) int64_t bad_row[2];
    char *wb = (char *)w, *sb = (char *)scales, *ob = (char *)out, *eb = (char *)stats;
    CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 0, 32, q, scales, sd, zp, stats, stats + 4, bad_row,
                          1, 0),
             AXL_OK);
    CHECK_EQ(bad_row[0], -1);
    CHECK_EQ(axl_dequantize(q, scales, sd, zp, 4, 64, 8, 32, out, AXL_F32, 1, 0), AXL_OK);

    /* dtypes */
    const int bad_dtypes[] = {-1, AXL_I8, AXL_U8, AXL_DTYPE_COUNT, 99};
    for (size_t i = 0; i < sizeof bad_dtypes / sizeof *bad_dtypes; i++) {
        CHECK_EQ(axl_quantize(w, bad_dtypes[i], 4, 64, 8, 0, 32, q, scales, sd, zp, NULL, NULL,
                              NULL, 1, 0),
                 AXL_ERR_BAD_DTYPE);
        CHECK_EQ(axl_dequantize(q, scales, sd, zp, 4, 64, 8, 32, out, bad_dtypes[i], 1, 0),
                 AXL_ERR_BAD_DTYPE);
    }
    /* scale dtypes: f32, bf16 or f16 only; checked with the other dtypes, before anything else */
    const int bad_scale_dtypes[] = {-1, AXL_I8, AXL_U8, AXL_DTYPE_COUNT, 99};
    for (size_t i = 0; i < sizeof bad_scale_dtypes / sizeof *bad_scale_dtypes; i++) {
        const int bsd = bad_scale_dtypes[i];
        CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 0, 32, q, scales, bsd, zp, NULL, NULL, NULL, 1,
                              0),
                 AXL_ERR_BAD_DTYPE);
        CHECK_EQ(axl_dequantize(q, scales, bsd, zp, 4, 64, 8, 32, out, AXL_F32, 1, 0),
                 AXL_ERR_BAD_DTYPE);
        CHECK_EQ(axl_quantize(NULL, AXL_F32, -1, 64, 3, 0, 32, NULL, NULL, bsd, NULL, NULL, NULL,
                              NULL, 1, 0),
                 AXL_ERR_BAD_DTYPE);
        CHECK_EQ(axl_quantize(NULL, AXL_F32, 0, 0, 8, 0, 0, NULL, NULL, bsd, NULL, NULL, NULL, NULL,
                              1, 0),
                 AXL_ERR_BAD_DTYPE); /* also for an empty matrix */
        CHECK_EQ(axl_dequantize(NULL, NULL, bsd, NULL, 0, 0, 8, 0, NULL, AXL_F32, 1, 0),
                 AXL_ERR_BAD_DTYPE);
    }
    /* sizes */
    const int64_t bad_sizes[][2] = {{-1, 64}, {4, -1}, {INT64_MIN, 64}, {INT64_MAX, 2},
                                    {(int64_t)1 << 40, (int64_t)1 << 40}};
    for (size_t i = 0; i < sizeof bad_sizes / sizeof *bad_sizes; i++) {
        int64_t r = bad_sizes[i][0], c = bad_sizes[i][1];
        CHECK_EQ(axl_quantize(w, AXL_F32, r, c, 8, 1, c, q, scales, sd, NULL, NULL, NULL, NULL, 1,
                              0),
                 AXL_ERR_BAD_SIZE);
        CHECK_EQ(axl_dequantize(q, scales, sd, NULL, r, c, 8, c, out, AXL_F32, 1, 0),
                 AXL_ERR_BAD_SIZE);
    }
    /* formats */
    const int bad_bits[] = {0, 1, 2, 3, 5, 7, 16, -8};
    for (size_t i = 0; i < sizeof bad_bits / sizeof *bad_bits; i++) {
        CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, bad_bits[i], 1, 32, q, scales, sd, NULL, NULL,
                              NULL, NULL, 1, 0),
                 AXL_ERR_BAD_FORMAT);
        CHECK_EQ(axl_dequantize(q, scales, sd, NULL, 4, 64, bad_bits[i], 32, out, AXL_F32, 1, 0),
                 AXL_ERR_BAD_FORMAT);
    }
    CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 2, 32, q, scales, sd, zp, NULL, NULL, NULL, 1, 0),
             AXL_ERR_BAD_FORMAT);
    CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, -1, 32, q, scales, sd, zp, NULL, NULL, NULL, 1, 0),
             AXL_ERR_BAD_FORMAT);
    /* block sizes: any >= 1 (ragged, or above cols: one block per row); only 0 with cols 0 */
    const int64_t good_blocks[][2] = {{64, 16}, {64, 48}, {64, 128}, {96, 64}, {100, 50},
                                      {100, 32}, {7, 1}, {7, 14}, {7, 3}};
    for (size_t i = 0; i < sizeof good_blocks / sizeof *good_blocks; i++) {
        int64_t c = good_blocks[i][0], b = good_blocks[i][1];
        CHECK_MSG(axl_quantize(w, AXL_F32, 2, c, 8, 1, b, q, scales, sd, NULL, NULL, NULL, NULL, 1,
                               0) == AXL_OK,
                  "cols %lld block %lld", (long long)c, (long long)b);
        CHECK_MSG(axl_dequantize(q, scales, sd, NULL, 2, c, 8, b, out, AXL_F32, 1, 0) == AXL_OK,
                  "cols %lld block %lld", (long long)c, (long long)b);
    }
    const int64_t bad_blocks[][2] = {{64, 0}, {64, -32}, {64, -1}, {7, 0}, {1, INT64_MIN}};
    for (size_t i = 0; i < sizeof bad_blocks / sizeof *bad_blocks; i++) {
        int64_t c = bad_blocks[i][0], b = bad_blocks[i][1];
        CHECK_MSG(axl_quantize(w, AXL_F32, 2, c, 8, 1, b, q, scales, sd, NULL, NULL, NULL, NULL, 1,
                               0) == AXL_ERR_BAD_SIZE,
                  "cols %lld block %lld", (long long)c, (long long)b);
        CHECK_MSG(axl_dequantize(q, scales, sd, NULL, 2, c, 8, b, out, AXL_F32, 1, 0) ==
                      AXL_ERR_BAD_SIZE,
                  "cols %lld block %lld", (long long)c, (long long)b);
    }
    CHECK_EQ(axl_quantize(w, AXL_F32, 1, 96, 8, 1, 96, q, scales, sd, NULL, NULL, NULL, NULL, 1, 0),
             AXL_OK);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 96, 8, 1, 32, q, scales, sd, NULL, NULL, NULL, NULL, 1, 0),
             AXL_OK);
    CHECK_EQ(axl_quantize(w, AXL_F32, 3, 77, 4, 0, 77, q, scales, sd, zp, NULL, NULL, NULL, 1, 0),
             AXL_OK);
    /* threads and ISAs */
    CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 0, 32, q, scales, sd, zp, NULL, NULL, NULL, -1, 0),
             AXL_ERR_BAD_THREADS);
    CHECK_EQ(axl_dequantize(q, scales, sd, zp, 4, 64, 8, 32, out, AXL_F32, INT32_MIN, 0),
             AXL_ERR_BAD_THREADS);
    const int bad_isas[] = {-1, AXL_ISA_COUNT, 99};
    for (size_t i = 0; i < sizeof bad_isas / sizeof *bad_isas; i++) {
        CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 0, 32, q, scales, sd, zp, NULL, NULL, NULL, 1,
                              bad_isas[i]),
                 AXL_ERR_UNSUPPORTED_ISA);
        CHECK_EQ(axl_dequantize(q, scales, sd, zp, 4, 64, 8, 32, out, AXL_F32, 1, bad_isas[i]),
                 AXL_ERR_UNSUPPORTED_ISA);
    }
    for (int isa = AXL_ISA_AVX2; isa < AXL_ISA_COUNT; isa++)
        if (!isa_available(isa))
            CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 1, 32, q, scales, sd, NULL, NULL, NULL,
                                  NULL, 1, isa),
                     AXL_ERR_UNSUPPORTED_ISA);

    /* NULL pointers: allowed only for empty matrices */
    CHECK_EQ(axl_quantize(NULL, AXL_F32, 4, 64, 8, 0, 32, q, scales, sd, zp, NULL, NULL, NULL, 1,
                          0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 0, 32, NULL, scales, sd, zp, NULL, NULL, NULL, 1,
                          0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 0, 32, q, NULL, sd, zp, NULL, NULL, NULL, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 0, 32, q, scales, sd, NULL, NULL, NULL, NULL, 1, 0),
             AXL_ERR_NULL_POINTER); /* asymmetric needs zero points */
    CHECK_EQ(axl_quantize(w, AXL_F32, 4, 64, 8, 1, 32, q, scales, sd, NULL, NULL, NULL, NULL, 1, 0),
             AXL_OK);
    CHECK_EQ(axl_dequantize(NULL, scales, sd, zp, 4, 64, 8, 32, out, AXL_F32, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(axl_dequantize(q, NULL, sd, zp, 4, 64, 8, 32, out, AXL_F32, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(axl_dequantize(q, scales, sd, zp, 4, 64, 8, 32, NULL, AXL_F32, 1, 0),
             AXL_ERR_NULL_POINTER);
    bad_row[0] = 5;
    CHECK_EQ(axl_quantize(NULL, AXL_F32, 0, 64, 8, 0, 32, NULL, NULL, sd, NULL, NULL, NULL, bad_row,
                          0, 0),
             AXL_OK);
    CHECK_EQ(bad_row[0], -1);
    CHECK_EQ(axl_quantize(NULL, AXL_BF16, 5, 0, 4, 0, 0, NULL, NULL, sd, NULL, NULL, NULL, NULL, 0,
                          0),
             AXL_OK); /* cols 0: per-channel with no blocks */
    CHECK_EQ(axl_quantize(NULL, AXL_BF16, 5, 0, 4, 0, 64, NULL, NULL, sd, NULL, NULL, NULL, NULL, 0,
                          0),
             AXL_OK);
    CHECK_EQ(axl_dequantize(NULL, NULL, sd, NULL, 0, 64, 4, 32, NULL, AXL_F16, 0, 0), AXL_OK);

    /* misaligned */
    CHECK_EQ(axl_quantize(wb + 2, AXL_F32, 2, 32, 8, 1, 32, q, scales, sd, NULL, NULL, NULL, NULL,
                          1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_quantize(wb + 1, AXL_BF16, 2, 32, 8, 1, 32, q, scales, sd, NULL, NULL, NULL, NULL,
                          1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_quantize(wb + 2, AXL_BF16, 2, 32, 8, 1, 32, q, scales, sd, NULL, NULL, NULL, NULL,
                          1, 0),
             AXL_OK);
    /* scales: aligned to the size of their dtype */
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, sb + 2, sd, NULL, NULL, NULL, NULL, 1, 0),
             sd == AXL_F32 ? AXL_ERR_MISALIGNED : AXL_OK);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, sb + 1, sd, NULL, NULL, NULL, NULL, 1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q + 1, scales, sd, zp + 1, NULL, NULL, NULL,
                          1, 0),
             AXL_OK); /* bytes have no alignment */
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, scales, sd, NULL, (float *)(eb + 1), NULL,
                          NULL, 1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, scales, sd, NULL, NULL, (float *)(eb + 2),
                          NULL, 1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, scales, sd, NULL, NULL, NULL,
                          (int64_t *)((char *)bad_row + 4), 1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_dequantize(q, sb + 1, sd, NULL, 2, 32, 8, 32, out, AXL_F32, 1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_dequantize(q, sb + 2, sd, NULL, 2, 32, 8, 32, out, AXL_F32, 1, 0),
             sd == AXL_F32 ? AXL_ERR_MISALIGNED : AXL_OK);
    CHECK_EQ(axl_dequantize(q, scales, sd, NULL, 2, 32, 8, 32, ob + 2, AXL_F32, 1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_dequantize(q, scales, sd, NULL, 2, 32, 8, 32, ob + 1, AXL_BF16, 1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_dequantize(q, scales, sd, NULL, 2, 32, 8, 32, ob + 2, AXL_BF16, 1, 0), AXL_OK);

    /* overlaps: every output against w and against each other; adjacency is fine */
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, wb + 252, scales, sd, NULL, NULL, NULL, NULL,
                          1, 0),
             AXL_ERR_OVERLAP); /* w is 256 bytes */
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, wb + 256, scales, sd, NULL, NULL, NULL, NULL,
                          1, 0),
             AXL_OK);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, w + 10, sd, NULL, NULL, NULL, NULL, 1, 0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 0, 32, q, scales, sd, (int8_t *)w, NULL, NULL, NULL,
                          1, 0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, scales, sd, NULL, w, NULL, NULL, 1, 0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, scales, sd, NULL, NULL, w + 63, NULL, 1,
                          0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, scales, sd, NULL, NULL, NULL,
                          (int64_t *)(w + 2), 1, 0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, scales, sd, NULL, NULL, NULL,
                          (int64_t *)(w + 64), 1, 0),
             AXL_OK);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, (float *)(q + 60), sd, NULL, NULL, NULL,
                          NULL, 1, 0),
             AXL_ERR_OVERLAP); /* q is 64 bytes */
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, (float *)(q + 64), sd, NULL, NULL, NULL,
                          NULL, 1, 0),
             AXL_OK);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, scales, sd, NULL, stats, stats + 1, NULL,
                          1, 0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 1, 32, q, scales, sd, NULL, stats, stats + 2, NULL,
                          1, 0),
             AXL_OK);
    /* 2 scales: 8 bytes of f32, 4 of bf16 */
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 0, 32, q, scales, sd, (int8_t *)scales + 4, NULL,
                          NULL, NULL, 1, 0),
             sd == AXL_F32 ? AXL_ERR_OVERLAP : AXL_OK);
    CHECK_EQ(axl_quantize(w, AXL_F32, 2, 32, 8, 0, 32, q, scales, sd, (int8_t *)scales + 3, NULL,
                          NULL, NULL, 1, 0),
             AXL_ERR_OVERLAP);
    {   /* out starting 4 bytes after the scales: inside f32 scales, right after bf16 ones. The
         * buffer holds the 2 x 32 floats written in the second case (scales[] alone did not:
         * an overflow only AVX2's plain stores showed to ASan; AVX-512's masked stores are not
         * instrumented). */
        _Alignas(64) float adjacent[2 + 2 * 32];
        memcpy(adjacent, scales, 8);
        CHECK_EQ(axl_dequantize(q, adjacent, sd, NULL, 2, 32, 8, 32, (char *)adjacent + 4,
                                AXL_F32, 1, 0),
                 sd == AXL_F32 ? AXL_ERR_OVERLAP : AXL_OK);
    }
    CHECK_EQ(axl_dequantize(q, scales, sd, NULL, 2, 32, 8, 32, (float *)(q + 32), AXL_F32, 1, 0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(axl_dequantize(q, scales, sd, NULL, 2, 32, 8, 32, scales, AXL_F32, 1, 0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(axl_dequantize(q, scales, sd, zp, 2, 32, 8, 32, (float *)zp, AXL_BF16, 1, 0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(axl_dequantize(q, (float *)q, sd, (int8_t *)q, 2, 32, 8, 32, out, AXL_F32, 1, 0),
             AXL_OK); /* inputs may share bytes: they are only read */
}

void test_quant(void) {
    test_goldens();
    test_clamps_bind();
    test_isas_match_reference();
    test_ragged_blocks();
    test_threads();
    test_large_outputs();
    test_fp_environment();
    test_zero_and_tiny();
    test_non_finite();
    test_symmetric_zero_points();
    test_thread_failure();
    test_f16_scales();
    test_search();
    test_search_groups();
    test_bad_arguments(AXL_F32);
    test_bad_arguments(AXL_BF16);
    test_bad_arguments(AXL_F16);
}
