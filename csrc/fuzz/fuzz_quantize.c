/* fuzz_quantize.c - libFuzzer target for axl_quantize and axl_dequantize (autoxla.h).
 *
 * Input: 12 parameter bytes (fault, dtypes, bits, symmetric, rows, cols / block size (whole
 * blocks of 32..256, ragged blocks of 1..64, or per-channel),
 * optional outputs, threads, isa, value mode), then the weight's element bits (repeated
 * to fill the matrix; NaN, Inf, huge and subnormal values come as they are, or, in the
 * value modes, with exponents held in a narrow range so that most blocks are finite and
 * the tiny-scale and subnormal paths are reached).
 *
 * Checks, each a finding when it fails:
 *   - the status is one of the conditions the arguments meet (at most one is made
 *     invalid on purpose; fuzz_util.h);
 *   - every ISA this CPU has (scalar, avx2, avx512), and a threaded run, give the same
 *     status, bad_row and output bytes as the scalar one (autoxla.h: identical results);
 *   - a successful quantization keeps the documented format and bounds: q within its
 *     range (odd 4-bit rows end in a 0 nibble), zero points 0 (symmetric) or in range,
 *     bf16 scales that are bf16 values, blocks stored as zeros only when all elements are
 *     below 2^-120, and |x - y| <= scale / 2 plus fp32 rounding for every element;
 *   - max_err and sqnr_db equal their definition computed here in double;
 *   - axl_dequantize gives (float)(q - zp) * scale bit for bit for F32 (and that result
 *     through axl_convert for BF16 / F16) on every ISA, also for arbitrary q, scales and
 *     zero points taken from the input. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"

#define MAX_NUMEL ((int64_t)1 << 17)

enum fault {
    F_SRC_DTYPE, F_SCALE_DTYPE, F_NEG_ROWS, F_NEG_COLS, F_BITS, F_SYMMETRIC, F_BLOCK,
    F_THREADS, F_ISA, F_NULL_Q, F_NULL_SCALES, F_NULL_ZP, F_MISALIGNED_W, F_MISALIGNED_SCALES,
    F_MISALIGNED_BAD_ROW, F_MISALIGNED_STATS, F_OVERLAP, F_OVERLAP_W, F_DST_DTYPE,
    F_NONE
};

typedef struct quant_out {
    uint8_t *q, *scales;
    int8_t *zp;
    float *max_err, *sqnr;
    int64_t *bad_row;
} quant_out;

typedef struct shape {
    int64_t rows, cols, block, groups;
    int bits, symmetric, src_dtype, scale_dtype;
    size_t q_bytes, scale_bytes, zp_bytes, w_bytes;
} shape;

static void alloc_out(quant_out *o, const shape *s, int want_zp, int want_stats, int want_bad) {
    o->q = xmalloc(s->q_bytes);
    o->scales = xmalloc(s->scale_bytes);
    o->zp = want_zp ? xmalloc(s->zp_bytes) : NULL;
    o->max_err = want_stats & 1 ? xmalloc((size_t)s->rows * 4) : NULL;
    o->sqnr = want_stats & 2 ? xmalloc((size_t)s->rows * 4) : NULL;
    o->bad_row = want_bad ? xmalloc(8) : NULL;
    memset(o->q, 0xCD, s->q_bytes);
    memset(o->scales, 0xCD, s->scale_bytes);
    if (o->zp) memset(o->zp, 0xCD, s->zp_bytes);
    if (o->max_err) memset(o->max_err, 0xCD, (size_t)s->rows * 4);
    if (o->sqnr) memset(o->sqnr, 0xCD, (size_t)s->rows * 4);
    if (o->bad_row) *o->bad_row = 0x5A5A;
}

static void free_out(quant_out *o) {
    free(o->q);
    free(o->scales);
    free(o->zp);
    free(o->max_err);
    free(o->sqnr);
    free(o->bad_row);
}

static void same_bytes(const char *what, int isa, const void *a, const void *b, size_t n) {
    if (n == 0 || !a || !b || memcmp(a, b, n) == 0) return;
    size_t i = 0;
    while (((const uint8_t *)a)[i] == ((const uint8_t *)b)[i]) i++;
    fail("%s: isa %s differs from the first call's result at byte %zu (0x%02x vs 0x%02x)", what,
         axl_isa_name(isa), i, ((const uint8_t *)a)[i], ((const uint8_t *)b)[i]);
}

static float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t bits_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Element k of w widened to fp32 (bf16 by a shift; f16 decoded here, exactly). */
static float widen(const void *w, int dtype, int64_t k) {
    if (dtype == AXL_F32) return ((const float *)w)[k];
    uint16_t h = ((const uint16_t *)w)[k];
    if (dtype == AXL_BF16) return f32_of_bits((uint32_t)h << 16);
    int e = (h >> 10) & 31, m = h & 1023;
    float mag = e == 0 ? ldexpf((float)m, -24)
              : e == 31 ? (m ? NAN : INFINITY)
                        : ldexpf((float)(m | 1024), e - 25);
    return h & 0x8000 ? -mag : mag;
}

static int q_value(const uint8_t *q, const shape *s, int64_t r, int64_t c) {
    if (s->bits == 8) return (int8_t)q[r * s->cols + c];
    uint8_t byte = q[r * ((s->cols + 1) / 2) + c / 2];
    int nib = c & 1 ? byte >> 4 : byte & 15;
    return nib >= 8 ? nib - 16 : nib;
}

static float scale_value(const uint8_t *scales, int dtype, int64_t i) {
    if (dtype == AXL_F32) {
        float f;
        memcpy(&f, scales + i * 4, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, scales + i * 2, 2);
    if (dtype == AXL_F16) { /* NaN as F16C widens it: sign, quiet bit set, payload kept */
        if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF))
            return f32_of_bits((uint32_t)(h & 0x8000) << 16 | 0x7FC00000u | (uint32_t)(h & 0x3FF) << 13);
        return widen(&h, AXL_F16, 0);
    }
    return f32_of_bits((uint32_t)h << 16);
}

/* One past the last element of block g: the last block of a row may be short. */
static int64_t block_end(const shape *s, int64_t g) {
    int64_t k1 = (g + 1) * s->block;
    return k1 < s->cols ? k1 : s->cols;
}

/* The documented properties of a successful quantization (scalar result). */
static void check_quantized(const void *w, const shape *s, const quant_out *o) {
    int qmax = s->bits == 8 ? 127 : 7, qmin = s->symmetric ? -qmax : -qmax - 1;
    for (int64_t r = 0; r < s->rows; r++) {
        double lanes_sig[16] = {0}, lanes_noise[16] = {0}, max_err = 0;
        if (s->bits == 4 && s->cols % 2 && o->q[r * ((s->cols + 1) / 2) + s->cols / 2] >> 4)
            fail("row %lld: the last byte's high nibble is not 0 (odd cols)", (long long)r);
        for (int64_t g = 0; g < s->groups; g++) {
            float scale = scale_value(o->scales, s->scale_dtype, r * s->groups + g);
            int zp = o->zp ? o->zp[r * s->groups + g] : 0;
            if (!(scale >= 0) || isinf(scale)) fail("scale %g is not finite >= 0", scale);
            if (s->scale_dtype == AXL_BF16 && (bits_of_f32(scale) & 0xFFFF))
                fail("bf16 scale with low bits");
            if (s->scale_dtype == AXL_F16 && scale > 65504) fail("f16 scale %a", scale);
            if (s->symmetric && zp != 0) fail("symmetric zero point %d", zp);
            if (zp < qmin || zp > qmax) fail("zero point %d outside [%d, %d]", zp, qmin, qmax);
            for (int64_t c = g * s->block; c < block_end(s, g); c++) {
                float x = widen(w, s->src_dtype, r * s->cols + c);
                int q = q_value(o->q, s, r, c);
                if (q < qmin || q > qmax) fail("q %d outside [%d, %d]", q, qmin, qmax);
                if (scale == 0) {
                    if (q != 0 || zp != 0) fail("zero block with q %d zp %d", q, zp);
                    if (!(fabsf(x) < 0x1p-120f)) fail("block stored as zeros holds %a", x);
                }
                float y = (float)(q - zp) * scale;
                double err = (double)x - (double)y;
                double bound = (double)scale * (0.5 + 0x1p-12) + 0x1p-148;
                if (scale > 0 && fabs(err) > bound) /* kept blocks only */
                    fail("row %lld col %lld: |x - y| = |%a - %a| above scale/2 (scale %a)",
                         (long long)r, (long long)c, x, y, scale);
                if (fabs(err) > max_err) max_err = fabs(err);
                lanes_sig[(c - g * s->block) % 16] += (double)x * (double)x;
                lanes_noise[(c - g * s->block) % 16] += err * err;
            }
        }
        double sig = 0, noise = 0;
        for (int l = 0; l < 16; l++) {
            sig += lanes_sig[l];
            noise += lanes_noise[l];
        }
        float sq = noise == 0 ? INFINITY : (float)(10 * log10(sig / noise));
        if (o->max_err && bits_of_f32(o->max_err[r]) != bits_of_f32((float)max_err))
            fail("row %lld: max_err %a, defined %a", (long long)r, o->max_err[r], (float)max_err);
        if (o->sqnr && bits_of_f32(o->sqnr[r]) != bits_of_f32(sq))
            fail("row %lld: sqnr_db %a, defined %a", (long long)r, o->sqnr[r], sq);
    }
}

/* axl_dequantize on every ISA against the definition, for q / scales / zp as given. */
static void check_dequantize(const uint8_t *q, const uint8_t *scales, const int8_t *zp,
                             const shape *s, int dst_dtype, int nthreads) {
    int64_t numel = s->rows * s->cols;
    float *want = xmalloc((size_t)numel * 4);
    for (int64_t r = 0; r < s->rows; r++)
        for (int64_t c = 0; c < s->cols; c++) {
            int64_t g = r * s->groups + c / s->block;
            want[r * s->cols + c] =
                (float)(q_value(q, s, r, c) - (zp ? zp[g] : 0)) * scale_value(scales, s->scale_dtype, g);
        }
    size_t ds = dtype_size(dst_dtype);
    uint8_t *want_dst = (uint8_t *)want;
    if (dst_dtype != AXL_F32) {
        want_dst = xmalloc((size_t)numel * ds);
        int st = axl_convert(want, AXL_F32, want_dst, dst_dtype, numel, 1, AXL_ISA_SCALAR);
        if (st != AXL_OK) fail("reference axl_convert failed: %d", st);
    }
    uint8_t *out = xmalloc((size_t)numel * ds);
    for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
        if (!isa_available(isa)) continue;
        for (int t = 0; t < 2; t++) {
            memset(out, 0xCD, (size_t)numel * ds);
            int st = axl_dequantize(q, scales, s->scale_dtype, zp, s->rows, s->cols, s->bits,
                                    s->block, out, dst_dtype, t ? nthreads : 1, isa);
            if (st != AXL_OK) fail("axl_dequantize on %s: status %d", axl_isa_name(isa), st);
            if (memcmp(out, want_dst, (size_t)numel * ds)) {
                int64_t i = 0;
                while (memcmp(out + i * ds, want_dst + i * ds, ds) == 0) i++;
                fail("axl_dequantize on %s (dst %d, %d threads): element %lld differs from "
                     "(q - zp) * scale",
                     axl_isa_name(isa), dst_dtype, t ? nthreads : 1, (long long)i);
            }
        }
    }
    free(out);
    if (want_dst != (uint8_t *)want) free(want_dst);
    free(want);
}

/* s rounded up to a bf16 value (s finite, >= 0), as autoxla.h defines the bf16 scale. */
static float bf16_round_up(float s) {
    uint32_t b = bits_of_f32(s);
    if (b & 0xFFFF) b = (b | 0xFFFF) + 1;
    return f32_of_bits(b);
}

/* s rounded up to an fp16 value (s finite, >= 0), +Inf above 65504: the smallest multiple
 * of the fp16 quantum at s (2^(e - 10) in [2^e, 2^(e+1)), 2^-24 below 2^-14) >= s. */
static float f16_round_up(float s) {
    if (s == 0) return 0;
    int e;
    frexp((double)s, &e);
    double quantum = ldexp(1.0, (e - 1 < -14 ? -14 : e - 1) - 10);
    double r = ceil((double)s / quantum) * quantum;
    return r > 65504 ? INFINITY : (float)r;
}

/* The lowest row holding a NaN or Inf, or (asymmetric) a block whose range hi - lo
 * overflows fp32, or a block whose grid overflows fp32: its scale (rounded as stored)
 * times qmax (symmetric) or qmax - qmin (asymmetric), whose extreme values would
 * dequantize to Inf (fuzz-found; tests/test_fuzz_regressions.c); -1 when there is none. */
static int64_t first_bad_row(const void *w, const shape *s) {
    const float qmax = s->bits == 8 ? 127.0f : 7.0f;
    const float range = s->symmetric ? qmax : 2 * qmax + 1;
    for (int64_t r = 0; r < s->rows; r++)
        for (int64_t g = 0; g < s->groups; g++) {
            float lo = 0, hi = 0, amax = 0;
            for (int64_t c = g * s->block; c < block_end(s, g); c++) {
                float x = widen(w, s->src_dtype, r * s->cols + c);
                if (!isfinite(x)) return r;
                if (x < lo) lo = x;
                if (x > hi) hi = x;
                if (fabsf(x) > amax) amax = fabsf(x);
            }
            if (!s->symmetric && isinf(hi - lo)) return r;
            float scale = s->symmetric ? amax / qmax : (hi - lo) / range;
            if (s->scale_dtype == AXL_BF16) scale = bf16_round_up(scale);
            if (s->scale_dtype == AXL_F16) scale = f16_round_up(scale); /* Inf: refused */
            if (isinf(scale * range)) return r;
        }
    return -1;
}

/* Element bits for mode 0 (as given) or a narrow exponent range (modes 1-3). */
static void make_weight(uint8_t *w, const shape *s, const uint8_t *data, size_t n, int mode,
                        uint8_t base) {
    int64_t numel = s->rows * s->cols;
    size_t es = dtype_size(s->src_dtype);
    for (int64_t i = 0; i < numel; i++) {
        uint32_t u = 0;
        for (size_t b = 0; b < es; b++)
            u |= (uint32_t)stream_byte(data, n, (size_t)i * es + b) << (8 * b);
        if (mode) {
            /* exponent = base + a few bits of the element: around 2^(base - bias) */
            int ebits = s->src_dtype == AXL_F16 ? 5 : 8, mbits = s->src_dtype == AXL_F32 ? 23
                                                                : s->src_dtype == AXL_BF16 ? 7 : 10;
            uint32_t emax = (1u << ebits) - 2; /* finite */
            uint32_t spread = mode == 1 ? 3 : mode == 2 ? 15 : 1;
            uint32_t e = ((u >> mbits) & spread) + base % (emax + 1);
            if (e > emax) e = emax;
            uint32_t sign = u >> (mbits + ebits) & 1;
            u = (u & ((1u << mbits) - 1)) | e << mbits | sign << (mbits + ebits);
        }
        memcpy(w + (size_t)i * es, &u, es);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_input in = {data, size};
    int fault = take(&in) % 40;
    if (fault > F_NONE) fault = F_NONE;
    shape s = {0};
    uint8_t b = take(&in);
    s.src_dtype = b % 3;
    s.scale_dtype = (b >> 2) & 1 ? ((b & 3) == 3 ? AXL_F16 : AXL_BF16) : AXL_F32;
    s.bits = (b >> 3) & 1 ? 4 : 8;
    s.symmetric = (b >> 4) & 1;
    int want_stats = (b >> 5) & 3, want_bad = b >> 7;
    b = take(&in);
    int want_zp = !s.symmetric || (b & 1);
    int dst_dtype = (b >> 1) % 3;
    int value_mode = (b >> 3) & 3;
    int nthreads = (b >> 5) % 4;
    uint8_t base = take(&in);
    b = take(&in);
    s.rows = b >= 0xF8 ? 64 * (b - 0xF7) : b % 9;
    uint16_t c16 = take16(&in);
    if (c16 & 0x8000) { /* blockwise: 1..8 blocks of 32..256 elements */
        s.block = 32 * (1 + (c16 & 7));
        s.cols = s.block * (1 + ((c16 >> 3) & 7));
    } else if (c16 & 0x4000) { /* ragged: any block size 1..64 (or above cols), any width */
        s.block = 1 + (c16 & 63);
        s.cols = (c16 >> 6) & 255;
    } else { /* per-channel: any width */
        s.cols = c16 % 1200;
        s.block = s.cols;
    }
    while (s.rows * s.cols > MAX_NUMEL) s.rows /= 2;
    int isa = take(&in) % 4;
    uint8_t extra = take(&in);
    int64_t rows = s.rows, cols = s.cols, block = s.block;

    s.groups = s.cols ? (s.cols + s.block - 1) / s.block : 0;
    int64_t numel = s.rows * s.cols;
    size_t es = dtype_size(s.src_dtype), scs = dtype_size(s.scale_dtype);
    s.w_bytes = (size_t)numel * es;
    s.q_bytes = (size_t)s.rows * (size_t)(s.bits == 8 ? s.cols : (s.cols + 1) / 2);
    s.scale_bytes = (size_t)(s.rows * s.groups) * scs;
    s.zp_bytes = (size_t)(s.rows * s.groups);

    uint8_t *w_mem = xmalloc(s.w_bytes + 1);
    make_weight(w_mem, &s, in.p, in.n, value_mode, base);

    /* The one bad argument, and the conditions it (with the rest) meets. */
    int src_dtype = s.src_dtype, scale_dtype = s.scale_dtype, bits = s.bits;
    int symmetric = s.symmetric, qisa = isa, qthreads = nthreads;
    const void *w = w_mem;
    quant_out o;
    alloc_out(&o, &s, want_zp, want_stats, want_bad);
    uint8_t *q = o.q, *scales = o.scales;
    int8_t *zp = o.zp;
    float *max_err = o.max_err, *sqnr = o.sqnr;
    int64_t *bad_row = o.bad_row;
    uint8_t *spare = NULL;
    uint32_t mask = 0;
    int empty = numel == 0;
    switch (fault) {
    case F_SRC_DTYPE: src_dtype = extra & 1 ? AXL_I8 + extra % 2 : -1 - extra % 3; break;
    case F_SCALE_DTYPE: scale_dtype = extra & 1 ? AXL_I8 + extra % 2 : AXL_DTYPE_COUNT + extra % 4; break;
    case F_NEG_ROWS: rows = -1 - extra; break;
    case F_NEG_COLS: cols = -1 - extra; break;
    case F_BITS: bits = extra & 1 ? 0 : 5 + extra % 4 * 3; break; /* 0, 5, 8 avoided below */
    case F_SYMMETRIC: symmetric = extra & 1 ? -1 : 2 + extra % 3; break;
    case F_BLOCK: block = extra & 1 ? -(int64_t)(extra % 3) : INT64_MIN + extra % 2; break;
    case F_THREADS: qthreads = -1 - extra % 5; break;
    case F_ISA: qisa = extra & 1 ? -1 : AXL_ISA_COUNT + extra % 3; break;
    case F_NULL_Q: q = NULL; break;
    case F_NULL_SCALES: scales = NULL; break;
    case F_NULL_ZP: zp = NULL; break;
    case F_MISALIGNED_W: w = w_mem + 1; memmove(w_mem + 1, w_mem, s.w_bytes); break;
    case F_MISALIGNED_SCALES:
        spare = xmalloc(s.scale_bytes + 1);
        scales = spare + 1;
        break;
    case F_MISALIGNED_BAD_ROW:
        spare = xmalloc(16);
        bad_row = (int64_t *)(spare + 1 + extra % 7);
        break;
    case F_MISALIGNED_STATS:
        spare = xmalloc((size_t)s.rows * 4 + 3);
        if (extra & 1) max_err = (float *)(spare + 1 + extra % 3);
        else sqnr = (float *)(spare + 1 + extra % 3);
        break;
    case F_OVERLAP: /* one output on top of another */
        if (extra & 1) scales = q;
        else if (o.zp) zp = (int8_t *)q + (extra >> 1) % (s.q_bytes ? s.q_bytes : 1);
        else if (o.max_err) max_err = (float *)o.scales;
        else scales = q;
        break;
    case F_OVERLAP_W: q = w_mem; break; /* an output on the weight */
    }
    if (bits == 8 && fault == F_BITS) bits = 3;
    if (src_dtype != AXL_F32 && src_dtype != AXL_BF16 && src_dtype != AXL_F16)
        mask |= BIT(AXL_ERR_BAD_DTYPE);
    if (scale_dtype != AXL_F32 && scale_dtype != AXL_BF16 && scale_dtype != AXL_F16)
        mask |= BIT(AXL_ERR_BAD_DTYPE);
    if (rows < 0 || cols < 0) mask |= BIT(AXL_ERR_BAD_SIZE);
    if ((bits != 4 && bits != 8) || (symmetric != 0 && symmetric != 1))
        mask |= BIT(AXL_ERR_BAD_FORMAT);
    if (cols >= 0 && block != cols && block < 1) mask |= BIT(AXL_ERR_BAD_SIZE);
    if (qthreads < 0) mask |= BIT(AXL_ERR_BAD_THREADS);
    if (!isa_available(qisa)) mask |= BIT(AXL_ERR_UNSUPPORTED_ISA);
    int structural = mask != 0;
    if (bad_row && (uintptr_t)bad_row % 8) mask |= BIT(AXL_ERR_MISALIGNED);
    if (!empty && !structural) {
        if (!q || !scales || (!symmetric && !zp)) mask |= BIT(AXL_ERR_NULL_POINTER);
        if ((uintptr_t)w % es || (scales && (uintptr_t)scales % scs) ||
            (max_err && (uintptr_t)max_err % 4) || (sqnr && (uintptr_t)sqnr % 4))
            mask |= BIT(AXL_ERR_MISALIGNED);
        const void *bufs[7] = {w, q, scales, zp, max_err, sqnr, bad_row};
        size_t lens[7] = {s.w_bytes, s.q_bytes, s.scale_bytes, zp ? s.zp_bytes : 0,
                          max_err ? (size_t)s.rows * 4 : 0, sqnr ? (size_t)s.rows * 4 : 0,
                          bad_row ? 8 : 0};
        for (int i = 1; i < 7; i++) /* outputs against every other buffer */
            for (int j = 0; j < 7; j++)
                if (i != j && bufs[i] && bufs[j] && ranges_overlap(bufs[i], lens[i], bufs[j], lens[j]))
                    mask |= BIT(AXL_ERR_OVERLAP);
    }
    if (fault == F_DST_DTYPE) fault = F_NONE; /* a dequantize fault: see below */

    int st = axl_quantize(w, src_dtype, rows, cols, bits, symmetric, block, q, scales,
                          scale_dtype, zp, max_err, sqnr, bad_row, qthreads, qisa);
    /* The buffers as passed (a fault may have replaced one; without a mask they are valid). */
    quant_out used = {q, scales, zp, max_err, sqnr, bad_row};
    int64_t want_bad_row = mask ? -1 : first_bad_row(w, &s);
    expect_status("axl_quantize", st, mask ? mask : want_bad_row >= 0 ? BIT(AXL_ERR_NON_FINITE) : 0);
    if (!mask && bad_row && *bad_row != want_bad_row)
        fail("axl_quantize: bad_row %lld, the first bad row is %lld", (long long)*bad_row,
             (long long)want_bad_row);

    if (!mask) {
        if (st == AXL_OK && !empty) check_quantized(w, &s, &used);
        /* Every ISA, one thread, and the scalar ISA threaded, as the first call. */
        for (int i = AXL_ISA_SCALAR; i <= AXL_ISA_COUNT; i++) {
            int visa = i == AXL_ISA_COUNT ? AXL_ISA_SCALAR : i;
            int vthreads = i == AXL_ISA_COUNT ? 2 : 1;
            if (!isa_available(visa)) continue;
            quant_out v;
            alloc_out(&v, &s, want_zp, want_stats, 1);
            int vst = axl_quantize(w, src_dtype, rows, cols, bits, symmetric, block, v.q,
                                   v.scales, scale_dtype, v.zp, v.max_err, v.sqnr, v.bad_row,
                                   vthreads, visa);
            if (vst != st) fail("axl_quantize on %s: status %d, first call %d", axl_isa_name(visa), vst, st);
            if (bad_row && *v.bad_row != *bad_row)
                fail("axl_quantize on %s: bad_row %lld, first call %lld", axl_isa_name(visa),
                     (long long)*v.bad_row, (long long)*bad_row);
            if (st == AXL_OK && !empty) { /* an empty matrix writes nothing */
                same_bytes("q", visa, v.q, used.q, s.q_bytes);
                same_bytes("scales", visa, v.scales, used.scales, s.scale_bytes);
                same_bytes("zero_points", visa, v.zp, used.zp, s.zp_bytes);
                same_bytes("max_err", visa, v.max_err, used.max_err, (size_t)s.rows * 4);
                same_bytes("sqnr_db", visa, v.sqnr, used.sqnr, (size_t)s.rows * 4);
            }
            free_out(&v);
        }
        if (st == AXL_OK && !empty)
            check_dequantize(used.q, used.scales, s.symmetric ? (extra & 1 ? used.zp : NULL) : used.zp, &s,
                             dst_dtype, nthreads);
    }

    /* The search (and the offset scheme): every ISA and a threaded run as the scalar one,
     * status, bad_row and bytes (autoxla.h, axl_quantize_spec). */
    if (!mask && !empty && (base & 0x80)) {
        const int scheme = s.symmetric ? AXL_Q_SYMMETRIC : (base & 0x40) ? AXL_Q_OFFSET : AXL_Q_ZERO_POINT;
        float *imp = NULL;
        if (base & 0x20) {
            imp = xmalloc((size_t)s.cols * 4);
            for (int64_t k = 0; k < s.cols; k++) imp[k] = (float)(stream_byte(in.p, in.n, (size_t)k) % 17) * 0.25f;
        }
        const axl_qspec spec = {s.bits, scheme, s.block, s.scale_dtype, 1, imp};
        quant_out ref;
        alloc_out(&ref, &s, 1, 3, 1);
        uint8_t *ref_off = xmalloc(s.scale_bytes);
        int8_t *zp_arg = scheme == AXL_Q_ZERO_POINT ? ref.zp : NULL;
        int rst = axl_quantize_spec(w, s.src_dtype, s.rows, s.cols, &spec, ref.q, ref.scales, zp_arg,
                                    ref_off, ref.max_err, ref.sqnr, ref.bad_row, 1, AXL_ISA_SCALAR);
        if (rst != AXL_OK && rst != AXL_ERR_NON_FINITE) fail("axl_quantize_spec: status %d", rst);
        for (int i = AXL_ISA_SCALAR; i <= AXL_ISA_COUNT; i++) {
            int visa = i == AXL_ISA_COUNT ? AXL_ISA_SCALAR : i;
            if (!isa_available(visa)) continue;
            quant_out v;
            alloc_out(&v, &s, 1, 3, 1);
            uint8_t *v_off = xmalloc(s.scale_bytes);
            int vst = axl_quantize_spec(w, s.src_dtype, s.rows, s.cols, &spec, v.q, v.scales,
                                        scheme == AXL_Q_ZERO_POINT ? v.zp : NULL, v_off, v.max_err,
                                        v.sqnr, v.bad_row, i == AXL_ISA_COUNT ? 3 : 1, visa);
            if (vst != rst || *v.bad_row != *ref.bad_row)
                fail("search on %s: status %d bad_row %lld, scalar %d %lld", axl_isa_name(visa), vst,
                     (long long)*v.bad_row, rst, (long long)*ref.bad_row);
            if (rst == AXL_OK) {
                same_bytes("search q", visa, v.q, ref.q, s.q_bytes);
                same_bytes("search scales", visa, v.scales, ref.scales, s.scale_bytes);
                if (zp_arg) same_bytes("search zero_points", visa, v.zp, ref.zp, s.zp_bytes);
                if (scheme == AXL_Q_OFFSET) same_bytes("search offsets", visa, v_off, ref_off, s.scale_bytes);
                same_bytes("search max_err", visa, v.max_err, ref.max_err, (size_t)s.rows * 4);
                same_bytes("search sqnr_db", visa, v.sqnr, ref.sqnr, (size_t)s.rows * 4);
            }
            free(v_off);
            free_out(&v);
        }
        free(ref_off);
        free_out(&ref);
        free(imp);
    }

    /* Dequantize arbitrary bytes: q, scales and zero points straight from the input. */
    if (fault == F_NONE && !empty && (extra & 6) == 6) {
        uint8_t *rq = xmalloc(s.q_bytes), *rs = xmalloc(s.scale_bytes);
        int8_t *rz = xmalloc(s.zp_bytes);
        size_t at = 0;
        for (size_t i = 0; i < s.q_bytes; i++) rq[i] = stream_byte(in.p, in.n, at++);
        for (size_t i = 0; i < s.scale_bytes; i++) rs[i] = stream_byte(in.p, in.n, at++);
        for (size_t i = 0; i < s.zp_bytes; i++) rz[i] = (int8_t)stream_byte(in.p, in.n, at++);
        check_dequantize(rq, rs, extra & 8 ? rz : NULL, &s, dst_dtype, nthreads);
        free(rq);
        free(rs);
        free(rz);
    }

    /* A bad dequantize: wrong dtype, or out on top of q. */
    if (!empty && (fault == F_NONE || fault == F_DST_DTYPE) && (extra & 0x70) == 0x70) {
        uint8_t *out = xmalloc((size_t)numel * 4);
        int bad_dtype = extra & 1;
        int dst = bad_dtype ? (extra & 2 ? AXL_I8 : -1) : AXL_F32;
        void *dst_ptr = bad_dtype ? (void *)out : (void *)o.q;
        int dst2 = bad_dtype ? dst : AXL_BF16 + (extra >> 7); /* 2-byte out on q: overlap */
        if (!bad_dtype && s.q_bytes < 2) dst_ptr = out; /* too small to overlap meaningfully */
        int want = bad_dtype ? AXL_ERR_BAD_DTYPE : dst_ptr == out ? AXL_OK : AXL_ERR_OVERLAP;
        if (!bad_dtype && want == AXL_ERR_OVERLAP) {
            /* q shorter than out: put out over q's end only through a buffer of out's size */
            uint8_t *big = xmalloc((size_t)numel * 2 + s.q_bytes);
            memcpy(big, o.q, s.q_bytes);
            int rst = axl_dequantize(big, o.scales, s.scale_dtype, o.zp, s.rows, s.cols, s.bits,
                                     s.block, big + s.q_bytes - 1 - (s.q_bytes - 1) % 2, dst2, 1,
                                     AXL_ISA_SCALAR);
            expect_status("axl_dequantize (out over q)", rst, BIT(AXL_ERR_OVERLAP));
            free(big);
        } else {
            int rst = axl_dequantize(o.q, o.scales, s.scale_dtype, o.zp, s.rows, s.cols, s.bits,
                                     s.block, dst_ptr, dst2, 1, AXL_ISA_SCALAR);
            expect_status("axl_dequantize", rst, want == AXL_OK ? 0 : BIT(want));
        }
        free(out);
    }

    free_out(&o);
    free(spare);
    free(w_mem);
    return 0;
}
