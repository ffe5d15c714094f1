/* internal.h - declarations shared by the C core's source files. Not installed. */
#ifndef AXL_INTERNAL_H
#define AXL_INTERNAL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

/* ---- quantization kernels -------------------------------------------------------------
 * Semantics on axl_quantize / axl_dequantize in autoxla.h. quant.c checks the arguments,
 * sets the FP environment and splits the rows over threads; a row kernel does one row.
 * Every vectorised variant must equal the _ref one bit for bit: the helpers below are the
 * one scalar definition of each step, used by the reference and by the vector kernels for
 * per-block set-up and tails. */

typedef struct axl_qformat {
    int64_t cols;   /* elements per row, >= 1 */
    int64_t block;  /* elements per block, 1..cols; the last block of a row may be shorter */
    int64_t groups; /* blocks per row: ceil(cols / block) */
    int bits;       /* 8 or 4 */
    int symmetric;  /* 1: q in [-qmax, qmax], zero point 0; 0: q in [qmin, qmax] */
    int stream;     /* 1: q is large; a kernel may write it with non-temporal stores */
    int scale_dtype; /* AXL_F32, AXL_BF16 or AXL_F16: how scales are stored (and rounded) */
    int scheme;      /* an axl_qscheme (symmetric == (scheme == AXL_Q_SYMMETRIC)) */
    int search;      /* 1: the error-minimising search (quant_search.c) */
    const float *importance; /* (cols,) weights of the search, or NULL for all 1 */
} axl_qformat;

/* Outputs q of at least this many bytes are written past the caches (where a kernel can):
 * they would only evict the weight being read, and a large q is read much later. */
#define AXL_STREAM_MIN_BYTES ((int64_t)1 << 20)

/* Lanes of the error statistics' double accumulators: the element at position p of its
 * block (p = k - g * block) goes to lane p % 16. */
#define AXL_QLANES 16

/* One past the last element of block g (the last block of a row may be short). */
static inline int64_t axl_block_end(const axl_qformat *f, int64_t g) {
    int64_t k1 = (g + 1) * f->block;
    return k1 < f->cols ? k1 : f->cols;
}

/* One row. w: (cols,) of the kernel's source dtype. q: (cols,) int8 for 8 bits, or
 * (ceil(cols/2),) uint8 of nibble pairs (element 2j low, 2j+1 high) for 4 bits.
 * scales: (groups,) of f->scale_dtype. zp: (groups,), or NULL (allowed only when symmetric;
 * when symmetric and non-NULL it receives zeros). max_err, sqnr_db: one float each, both
 * optional; the statistics are computed when either is given. Returns 0, or 1 if the row holds a NaN or
 * Inf or (asymmetric) a block's range overflows; the outputs are then partly written. */
typedef int (*axl_quant_row_fn)(const void *w, const axl_qformat *f, void *q, void *scales,
                                int8_t *zp, float *max_err, float *sqnr_db);

/* One row back: out (cols,) of the kernel's destination dtype from q (layout above),
 * scales (groups,) of f->scale_dtype and zp (groups,) or NULL for zero points of 0. */
typedef void (*axl_dequant_row_fn)(const void *q, const void *scales, const int8_t *zp,
                                   const axl_qformat *f, void *out);

#define AXL_DECLARE_QUANT(suffix)                                                          \
    int axl_quant_row_f32_##suffix(const void *w, const axl_qformat *f, void *q,           \
                                   void *scales, int8_t *zp, float *max_err,               \
                                   float *sqnr_db);                                        \
    int axl_quant_row_bf16_##suffix(const void *w, const axl_qformat *f, void *q,          \
                                    void *scales, int8_t *zp, float *max_err,              \
                                    float *sqnr_db);                                       \
    int axl_quant_row_f16_##suffix(const void *w, const axl_qformat *f, void *q,           \
                                   void *scales, int8_t *zp, float *max_err,               \
                                   float *sqnr_db);                                        \
    void axl_dequant_row_f32_##suffix(const void *q, const void *scales, const int8_t *zp,  \
                                      const axl_qformat *f, void *out);                    \
    void axl_dequant_row_bf16_##suffix(const void *q, const void *scales,                  \
                                       const int8_t *zp, const axl_qformat *f, void *out); \
    void axl_dequant_row_f16_##suffix(const void *q, const void *scales, const int8_t *zp,  \
                                      const axl_qformat *f, void *out);

/* The exported row kernels of one vectorised ISA file for one source dtype. The file defines
 * static quant_row_any(w, dtype, f, q, scales, zp, max_err, sqnr_db) and
 * dequant_row(q, scales, zp, f, out, dtype, bits) for itself (with bits a constant, so each width
 * is specialised); ATTR is its target attribute, suffix its ISA name. */
#define AXL_DEFINE_QUANT_ROWS(ATTR, suffix, name, dtype)                                   \
    ATTR int axl_quant_row_##name##_##suffix(const void *w, const axl_qformat *f, void *q, \
                                             void *scales, int8_t *zp, float *max_err,   \
                                             float *sqnr_db) {                           \
        return quant_row_any(w, dtype, f, q, scales, zp, max_err, sqnr_db);              \
    }                                                                                    \
    ATTR void axl_dequant_row_##name##_##suffix(const void *q, const void *scales,       \
                                                const int8_t *zp, const axl_qformat *f,   \
                                                void *out) {                             \
        if (f->bits == 8)                                                                \
            dequant_row(q, scales, zp, f, out, dtype, 8);                                \
        else                                                                             \
            dequant_row(q, scales, zp, f, out, dtype, 4);                                \
    }

AXL_DECLARE_QUANT(ref)
#if AXL_X86
AXL_DECLARE_QUANT(avx2)
AXL_DECLARE_QUANT(avx512)
#endif

/* The reference row kernels for any source / destination dtype: what a vectorised kernel
 * runs for a format it has no vector loop for (odd int4 blocks, AVX2 blocks that are not a
 * multiple of 16), so that the result is the reference's by construction. */
int axl_quant_row_ref_any(const void *w, int src_dtype, const axl_qformat *f, void *q,
                          void *scales, int8_t *zp, float *max_err, float *sqnr_db);
void axl_dequant_row_ref_any(const void *q, const void *scales, const int8_t *zp,
                             const axl_qformat *f, void *out, int dst_dtype);

/* Block g of a row, as the reference does it: set-up, q (4 bits: nibbles ORed into place
 * for an odd start), the scale and zero point, and, when signal is not NULL, the block's
 * elements added to the statistics lanes after those already there. Returns 1 if the
 * block is non-finite (as axl_quant_row_fn). For a vector kernel's short last block. */
int axl_quant_block_ref(const void *w, int src_dtype, const axl_qformat *f, int64_t g, void *q,
                        void *scales, int8_t *zp, double *signal, double *noise,
                        double *max_abs_err);

/* ---- the search and the offset scheme (quant_search.c) ---------------------------------
 * One candidate of a block: levels L = clamp(nearbyint((x - a) * inv) + zp, lo_q, hi_q),
 * d = L - zp, dequantized y = (float)d * scale (+ b when the scheme has an offset). */
typedef struct axl_qcand {
    float inv, a, scale, b;
    int32_t zp;
} axl_qcand;

/* The inner loops of the search, per ISA, over elements [k0, k1) of a row (imp: the row's
 * importance, NULL = all 1; every variant equal to the _ref one bit for bit):
 *   sums, for n <= AXL_QCANDS candidates c[i] with clamp ranges [lo_q[i], hi_q[i]]: out[0][i]
 *     = sum (imp * x) * d, out[1][i] = sum imp * (d * d), out[2][i] = sum imp * d, each in
 *     fp32 in element order (no FMA), d = L - zp as float (the vector kernel runs the
 *     candidates side by side, one per lane);
 *   error: lanes[p % 16] += (double)imp * (e * e) for the element at position p of the
 *     block, e = (double)x - (double)y, in double, each lane in element order. */
#define AXL_QCANDS 16
typedef void (*axl_qsums_fn)(const void *w, int src_dtype, const float *imp, int64_t k0,
                             int64_t k1, const axl_qcand *c, const int32_t *lo_q,
                             const int32_t *hi_q, int n, float out[3][AXL_QCANDS]);
typedef void (*axl_qerror_fn)(const void *w, int src_dtype, const float *imp, int64_t k0,
                              int64_t k1, const axl_qcand *c, int32_t lo_q, int32_t hi_q,
                              int offset, double lanes[AXL_QLANES]);

/*   range: over the block, the largest |x| as bits (*amax), the min and max (*mn, *mx, NaNs
 *     aside: a NaN or Inf shows in *amax), and, when offset, lw[p % 16] += imp,
 *     lx[p % 16] += imp * x in fp32, each lane in element order;
 *   write: the levels of candidate c stored into q (as quant_ref.c stores them) and, when
 *     signal is not NULL, the statistics lanes (axl_qstats_add, p % 16, without FMA). */
typedef void (*axl_qrange_fn)(const void *w, int src_dtype, const float *imp, int64_t k0,
                              int64_t k1, int offset, uint32_t *amax, float *mn, float *mx,
                              float lw[AXL_QLANES], float lx[AXL_QLANES]);
typedef void (*axl_qwrite_fn)(const void *w, int src_dtype, int64_t k0, int64_t k1,
                              const axl_qcand *c, int32_t lo_q, int32_t hi_q, int offset, int bits,
                              void *q, double *signal, double *noise, double *max_abs_err);

/*   group (NULL where an ISA has none): blocks g0 .. g0 + AXL_QGROUP - 1 of the row, all of
 *     f->block <= AXL_QGROUP_MAX_BLOCK elements, at once (one block per vector lane): each
 *     block's final candidate c[j] and clamp range [lo_q[j], hi_q[j]], bit for bit what the
 *     block-by-block set-up and search give. Returns 1 if a block is non-finite; the caller
 *     then redoes the blocks one by one (so the row fails where the reference's does). */
#define AXL_QGROUP 16
#define AXL_QGROUP_MAX_BLOCK 256
typedef int (*axl_qgroup_fn)(const void *w, int src_dtype, const axl_qformat *f, int64_t g0,
                             axl_qcand c[AXL_QGROUP], int32_t lo_q[AXL_QGROUP],
                             int32_t hi_q[AXL_QGROUP]);

typedef struct axl_qsearch_ops {
    axl_qsums_fn sums;
    axl_qerror_fn error;
    axl_qrange_fn range;
    axl_qwrite_fn write;
    axl_qgroup_fn group;
} axl_qsearch_ops;

/* The reference's write (for vector kernels' odd 4-bit blocks). */
void axl_qsearch_write_ref(const void *w, int src_dtype, int64_t k0, int64_t k1,
                           const axl_qcand *c, int32_t lo_q, int32_t hi_q, int offset, int bits,
                           void *q, double *signal, double *noise, double *max_abs_err);

extern const axl_qsearch_ops axl_qsearch_ref;
#if AXL_X86
extern const axl_qsearch_ops axl_qsearch_avx512;
int axl_qsearch_group_avx512(const void *w, int src_dtype, const axl_qformat *f, int64_t g0,
                             axl_qcand c[AXL_QGROUP], int32_t lo_q[AXL_QGROUP],
                             int32_t hi_q[AXL_QGROUP]);
#endif

/* One row with f->search or the offset scheme: every block through the scalar set-up and
 * candidate choice of quant_search.c, the ISA's inner loops `ops` (or 16 blocks at a time
 * through ops->group). As axl_quant_row_fn, plus offsets (groups,) of f->scale_dtype for
 * AXL_Q_OFFSET. */
int axl_quant_row_search(const void *w, int src_dtype, const axl_qformat *f, void *q,
                         void *scales, int8_t *zp, void *offsets, float *max_err,
                         float *sqnr_db, const axl_qsearch_ops *ops);

/* One row of the offset scheme back: y = (float)q * scale + offset. */
void axl_dequant_row_offset(const void *q, const void *scales, const void *offsets,
                            const axl_qformat *f, void *out, int dst_dtype);

static inline float axl_f32_from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint32_t axl_bits_of_f32(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* One element into a block's range: |x| as integer bits into *amax (a NaN or Inf cannot hide
 * in a max: its bits are >= those of Inf), x into [*lo, *hi]. The scalar range pass of every
 * kernel (reference, vector tails, the search). */
static inline void axl_range_add(float x, uint32_t *amax, float *lo, float *hi) {
    uint32_t a = axl_bits_of_f32(x) & 0x7FFFFFFFu;
    if (a > *amax) *amax = a;
    if (x < *lo) *lo = x;
    if (x > *hi) *hi = x;
}

/* Largest and smallest stored integer of a format; qmin = -qmax when symmetric. */
static inline int32_t axl_qmax(const axl_qformat *f) { return f->bits == 8 ? 127 : 7; }
static inline int32_t axl_qmin(const axl_qformat *f) {
    return f->symmetric ? -axl_qmax(f) : -axl_qmax(f) - 1;
}

/* nearbyint(v) for |v| < 2^22 in round-to-nearest-even (the mode quant.c sets): adding
 * 1.5 * 2^23 leaves no fraction bits. Exact for every |v| < 2^22; the kernels only round
 * values below 2^9 in magnitude. */
static inline float axl_round_small(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* The scale a block uses from s, its fp32 scale (finite, >= 0): s itself (AXL_F32), or s
 * rounded UP (toward +Inf: the smallest value of the dtype >= s; a value of the dtype, 0
 * included, stays as it is) to bf16 (AXL_BF16) or fp16 (AXL_F16), widened back to fp32.
 * bf16: for s >= 0 adding 0xFFFF to the bits carries into the kept 16 exactly when a
 * dropped bit is set, normal and subnormal s alike; s is at most FLT_MAX / 7, so the result
 * is finite. fp16: the nearest-even fp16, one fp16 step up if that is below s (positive
 * fp16 bit patterns are ordered); any s > 65504 gives +Inf, which the callers refuse (the
 * grid check: Inf * levels is Inf), and any 0 < s < 2^-24 gives 2^-24. Never below s, so
 * the block's range fits the grid of its rounded scale (see quant_avx512.c). */
static inline float axl_scale_round(float s, int scale_dtype) {
    if (scale_dtype == AXL_F32) return s;
    if (scale_dtype == AXL_BF16)
        return axl_f32_from_bits((axl_bits_of_f32(s) + 0xFFFFu) & 0xFFFF0000u);
    uint16_t h = axl_f32_bits_to_f16(axl_bits_of_f32(s));
    float y = axl_f32_from_bits(axl_f16_to_f32_bits(h));
    if (y < s) y = axl_f32_from_bits(axl_f16_to_f32_bits((uint16_t)(h + 1)));
    return y;
}

/* Stores scale (already rounded by axl_scale_round) as block g of a row's scales. */
static inline void axl_scale_store(void *scales, int scale_dtype, int64_t g, float scale) {
    if (scale_dtype == AXL_F32)
        ((float *)scales)[g] = scale;
    else if (scale_dtype == AXL_BF16) /* exact: scale is a bf16 value */
        ((uint16_t *)scales)[g] = (uint16_t)(axl_bits_of_f32(scale) >> 16);
    else /* exact: scale is an fp16 value */
        ((uint16_t *)scales)[g] = axl_f32_bits_to_f16(axl_bits_of_f32(scale));
}

/* Block g's stored scale, widened to fp32 (exact). */
static inline float axl_scale_load(const void *scales, int scale_dtype, int64_t g) {
    if (scale_dtype == AXL_F32) return ((const float *)scales)[g];
    uint16_t h = ((const uint16_t *)scales)[g];
    return axl_f32_from_bits(scale_dtype == AXL_BF16 ? (uint32_t)h << 16 : axl_f16_to_f32_bits(h));
}

/* A symmetric block's scale (rounded to scale_dtype) and its reciprocal from
 * amax = max |x| (finite, >= 0). A zero block (scale 0, or a reciprocal that overflows) gets
 * scale 0 and inv 0: every q is 0. */
static inline void axl_qparams_sym(float amax, float qmax, int scale_dtype, float *scale,
                                   float *inv) {
    float s = axl_scale_round(amax / qmax, scale_dtype);
    float r = s > 0 ? 1.0f / s : INFINITY;
    if (r == INFINITY) s = r = 0;
    *scale = s;
    *inv = r;
}

/* An asymmetric block's scale (rounded to scale_dtype), reciprocal and zero point from
 * lo = min(min, 0) and hi = max(max, 0) (finite). Returns 1 if hi - lo overflows (the fp32
 * scale would be Inf), else 0. A zero block gets scale 0, inv 0 and zero point 0. */
static inline int axl_qparams_asym(float lo, float hi, int32_t qmin, int32_t qmax,
                                   int scale_dtype, float *scale, float *inv, int32_t *zp) {
    float s = (hi - lo) / (float)(qmax - qmin);
    if (s == INFINITY) return 1;
    s = axl_scale_round(s, scale_dtype);
    float r = s > 0 ? 1.0f / s : INFINITY;
    if (r == INFINITY) {
        *scale = *inv = 0;
        *zp = 0;
        return 0;
    }
    int32_t z = qmin - (int32_t)axl_round_small(lo * r);
    *scale = s;
    *inv = r;
    *zp = z < qmin ? qmin : z > qmax ? qmax : z;
    return 0;
}

/* One stored integer: clamp(nearbyint(x * inv) + zp, qmin, qmax). */
static inline int32_t axl_qvalue(float x, float inv, int32_t zp, int32_t qmin, int32_t qmax) {
    int32_t v = (int32_t)axl_round_small(x * inv) + zp;
    return v < qmin ? qmin : v > qmax ? qmax : v;
}

/* The dequantized value of a stored integer: (float)(v - zp) * scale. */
static inline float axl_dqvalue(int32_t v, int32_t zp, float scale) {
    return (float)(v - zp) * scale;
}

/* A 4-bit two's complement nibble (0..15) as an int. */
static inline int32_t axl_nibble_value(uint32_t nibble) { return (int32_t)(nibble ^ 8u) - 8; }

/* Adds element x with dequantized value dq to one lane of the statistics.
 * Both products are exact doubles, so a vector kernel may fuse each with its sum (FMA) and
 * get the same bits: x has 24 significant bits, so x * x has at most 48. e = x - dq is exact
 * and has at most 26: if dq = 0, e = x; else |v| = |q - zp| >= 1, and with the block's scale
 * in [2^k, 2^(k+1)), |dq| = fl(|v| scale) >= 2^k and |x| >= (scale / 2)(1 - 2^-24) (x
 * rounded to v != 0, or was clamped to it from beyond), so both are multiples of 2^(k-25),
 * and of 2^(k-24) unless |x| < 2^(k-1), where v = +-1 and |e| <= (scale / 2)(1 + 2^-23) <
 * 2^k: 25 bits; elsewhere |e| <= scale (1/2 + 2^-13) < 2^(k+1) (half a step, plus fp32
 * rounding: no clamp costs more, see quant_avx512.c, also with bf16 scales, which round up):
 * 25 bits. Subnormals only have fewer. So e * e has at most 50 (52 would still be exact). The tests check both on every element they check the
 * formulas on (test_quant.c, check_formulas). */
static inline void axl_qstats_add(float x, float dq, double *signal, double *noise,
                                  double *max_abs_err) {
    double e = (double)x - (double)dq;
    double a = e < 0 ? -e : e;
    *signal += (double)x * (double)x;
    *noise += e * e;
    if (a > *max_abs_err) *max_abs_err = a;
}

/* Sums the lanes in order and writes the row's statistics (either pointer may be NULL). */
void axl_qstats_finish(const double signal[AXL_QLANES], const double noise[AXL_QLANES],
                       double max_abs_err, float *max_err, float *sqnr_db);

#endif /* AXL_INTERNAL_H */
