/* quant.c - axl_quantize and axl_dequantize: argument checks, kernel choice, the FP
 * environment, and rows split evenly over threads. */
#include <float.h>
#include <stdatomic.h>

#include "internal.h"
#include "parallel.h"

#if AXL_X86
#include <xmmintrin.h> /* _mm_getcsr / _mm_setcsr */
#endif

/* Below two of these elements per thread a call stays on the calling thread (as in
 * convert.c; a quantized element costs a little more than a converted one). */
#define MIN_PER_THREAD ((int64_t)1 << 16)

/* axl_parallel_for starts ranges at multiples of 64 indices (parallel.h): asking it for
 * T * WORKER_SPAN indices in ranges of at least WORKER_SPAN gives exactly T ranges, one
 * per worker, and each worker takes its own even share of the rows. */
#define WORKER_SPAN 64

/* The byte count of any buffer must fit in a ptrdiff_t, as for axl_convert. */
#define MAX_ELEMENTS ((int64_t)(PTRDIFF_MAX / 4))

#define FLOAT_TABLE(kind, suffix)                                                    \
    {                                                                                \
        [AXL_F32] = axl_##kind##_row_f32_##suffix,                                   \
        [AXL_BF16] = axl_##kind##_row_bf16_##suffix,                                 \
        [AXL_F16] = axl_##kind##_row_f16_##suffix,                                   \
    }

/* [isa][source dtype] */
static const axl_quant_row_fn quant_kernels[AXL_ISA_COUNT][3] = {
    [AXL_ISA_SCALAR] = FLOAT_TABLE(quant, ref),
#if AXL_X86
    [AXL_ISA_AVX2] = FLOAT_TABLE(quant, avx2),
    [AXL_ISA_AVX512] = FLOAT_TABLE(quant, avx512),
#endif
};

/* [isa]: the search's inner loops and group loop (AVX2 runs the reference's, one block at a
 * time). */
static const axl_qsearch_ops *const search_ops[AXL_ISA_COUNT] = {
    [AXL_ISA_SCALAR] = &axl_qsearch_ref,
#if AXL_X86
    [AXL_ISA_AVX2] = &axl_qsearch_ref,
    [AXL_ISA_AVX512] = &axl_qsearch_avx512,
#endif
};

/* [isa][destination dtype] */
static const axl_dequant_row_fn dequant_kernels[AXL_ISA_COUNT][3] = {
    [AXL_ISA_SCALAR] = FLOAT_TABLE(dequant, ref),
#if AXL_X86
    [AXL_ISA_AVX2] = FLOAT_TABLE(dequant, avx2),
    [AXL_ISA_AVX512] = FLOAT_TABLE(dequant, avx512),
#endif
};

/* ---- the FP environment ----------------------------------------------------------------
 * The arithmetic in autoxla.h is IEEE round-to-nearest-even with subnormals kept. A caller
 * may have set FTZ/DAZ (torch.set_flush_denormal) or another rounding mode on its thread,
 * and worker threads inherit it: every worker sets the default and restores the caller's
 * own value (sticky exception flags included) when it is done. */

typedef struct fp_env {
    unsigned int csr;
} fp_env;

static fp_env fp_enter(void) {
    fp_env saved = {0};
#if AXL_X86
    saved.csr = _mm_getcsr();
    _mm_setcsr(0x1F80u); /* all exceptions masked, round to nearest, no FTZ, no DAZ */
#endif
    return saved;
}

static void fp_leave(fp_env saved) {
#if AXL_X86
    _mm_setcsr(saved.csr);
#else
    (void)saved;
#endif
}

/* ---- splitting rows over threads --------------------------------------------------------- */

/* Workers for a rows x cols matrix of numel > 0 elements: at most nthreads (0: all CPUs)
 * and AXL_MAX_THREADS, one per MIN_PER_THREAD elements, at most one per row, at least 1. */
static int worker_count(int nthreads, int64_t rows, int64_t numel) {
    int64_t t = nthreads == 0 ? axl_num_cpus() : nthreads;
    if (t > AXL_MAX_THREADS) t = AXL_MAX_THREADS;
    if (t > numel / MIN_PER_THREAD) t = numel / MIN_PER_THREAD;
    if (t > rows) t = rows;
    return t < 1 ? 1 : (int)t;
}

/* Rows [*r0, *r1) of worker i of `workers`: the first rows % workers workers take one more. */
static void worker_rows(int64_t rows, int workers, int64_t i, int64_t *r0, int64_t *r1) {
    int64_t per = rows / workers, extra = rows % workers;
    *r0 = i * per + (i < extra ? i : extra);
    *r1 = *r0 + per + (i < extra ? 1 : 0);
}

/* ---- argument checks --------------------------------------------------------------------- */

static int is_float_dtype(int dtype) {
    return dtype == AXL_F32 || dtype == AXL_BF16 || dtype == AXL_F16;
}

static int is_scale_dtype(int dtype) { return is_float_dtype(dtype); }

static int check_sizes(int64_t rows, int64_t cols, int64_t *numel) {
    if (rows < 0 || cols < 0) return AXL_ERR_BAD_SIZE;
    if (cols > 0 && rows > MAX_ELEMENTS / cols) return AXL_ERR_BAD_SIZE;
    *numel = rows * cols;
    return AXL_OK;
}

/* Any block_size >= 1 (block_size == cols is valid also for cols == 0): G = ceil(cols /
 * block) blocks per row, the last one shorter when block does not divide cols; a block of
 * cols or more is one per row. *block is the size the kernels use, at most cols. */
static int check_block(int64_t cols, int64_t *block, int64_t *groups) {
    if (*block != cols && *block < 1) return AXL_ERR_BAD_SIZE;
    if (*block > cols) *block = cols;
    *groups = cols ? (cols - 1) / *block + 1 : 0;
    return AXL_OK;
}

typedef struct span {
    uintptr_t begin, end; /* end == begin: no buffer */
} span;

static span span_of(const void *p, uint64_t bytes) {
    uintptr_t b = (uintptr_t)p;
    return (span){b, p ? b + (uintptr_t)bytes : b};
}

static int spans_overlap(span a, span b) {
    return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end;
}

static int misaligned(const void *p, size_t size) { return p && (uintptr_t)p % size; }

/* ---- axl_quantize ------------------------------------------------------------------------ */

typedef struct quant_job {
    axl_quant_row_fn fn;
    axl_qformat fmt;
    int64_t rows;
    int workers;
    const char *w;
    size_t w_row; /* bytes per row of w */
    char *q;
    size_t q_row; /* bytes per row of q */
    char *scales;
    size_t scales_row; /* bytes per row of scales */
    int8_t *zp;
    char *offsets; /* AXL_Q_OFFSET only; scales_row bytes per row */
    const axl_qsearch_ops *search; /* the search / offset path (quant_search.c), or NULL */
    int src_dtype;
    float *max_err, *sqnr_db;
    atomic_int_fast64_t bad_row; /* lowest row found non-finite so far; rows if none */
} quant_job;

static void quant_worker(void *arg, int64_t begin, int64_t end) {
    quant_job *job = arg;
    (void)end;
    int64_t r0, r1;
    worker_rows(job->rows, job->workers, begin / WORKER_SPAN, &r0, &r1);
    const int64_t g = job->fmt.groups;
    fp_env env = fp_enter();
    for (int64_t r = r0; r < r1; r++) {
        /* A lower row already failed: this worker's rows cannot be the lowest. */
        if (r > atomic_load_explicit(&job->bad_row, memory_order_relaxed)) break;
        const char *w = job->w + (size_t)r * job->w_row;
        char *q = job->q + (size_t)r * job->q_row, *sc = job->scales + (size_t)r * job->scales_row;
        int8_t *zp = job->zp ? job->zp + r * g : NULL;
        float *me = job->max_err ? job->max_err + r : NULL, *sq = job->sqnr_db ? job->sqnr_db + r : NULL;
        int bad = job->search
                      ? axl_quant_row_search(w, job->src_dtype, &job->fmt, q, sc, zp,
                                             job->offsets ? job->offsets + (size_t)r * job->scales_row
                                                          : NULL,
                                             me, sq, job->search)
                      : job->fn(w, &job->fmt, q, sc, zp, me, sq);
        if (bad) {
            int_fast64_t seen = atomic_load(&job->bad_row);
            while (r < seen && !atomic_compare_exchange_weak(&job->bad_row, &seen, r)) {
            }
            break; /* the rest of this worker's rows are higher */
        }
    }
    fp_leave(env);
}

int axl_quantize_spec(const void *w, int src_dtype, int64_t rows, int64_t cols,
                      const axl_qspec *spec, void *q, void *scales, int8_t *zero_points,
                      void *offsets, float *max_err, float *sqnr_db, int64_t *bad_row,
                      int nthreads, int isa) {
    if (!spec) return AXL_ERR_NULL_POINTER;
    const int bits = spec->bits, scheme = spec->scheme, scale_dtype = spec->scale_dtype;
    const int symmetric = scheme == AXL_Q_SYMMETRIC;
    int64_t block_size = spec->block_size;
    if (!is_float_dtype(src_dtype) || !is_scale_dtype(scale_dtype)) return AXL_ERR_BAD_DTYPE;
    int64_t numel = 0, groups = 0;
    int status = check_sizes(rows, cols, &numel);
    if (status != AXL_OK) return status;
    if ((bits != 4 && bits != 8) || scheme < 0 || scheme >= AXL_Q_SCHEME_COUNT ||
        (spec->search != 0 && spec->search != 1))
        return AXL_ERR_BAD_FORMAT;
    status = check_block(cols, &block_size, &groups);
    if (status != AXL_OK) return status;
    if (nthreads < 0) return AXL_ERR_BAD_THREADS;
    status = axl_resolve_isa(isa, &isa);
    if (status != AXL_OK) return status;
    if (misaligned(bad_row, sizeof *bad_row)) return AXL_ERR_MISALIGNED;
    if (numel == 0) { /* empty matrices may carry NULL data pointers */
        if (bad_row) *bad_row = -1;
        return AXL_OK;
    }
    const int offset = scheme == AXL_Q_OFFSET;
    if (!w || !q || !scales || (scheme == AXL_Q_ZERO_POINT && !zero_points) ||
        (offset && !offsets))
        return AXL_ERR_NULL_POINTER;
    if (offset && zero_points) return AXL_ERR_BAD_FORMAT; /* no zero points in this scheme */
    const float *importance = spec->search ? spec->importance : NULL;

    size_t ws = axl_dtype_size(src_dtype), ss = axl_dtype_size(scale_dtype);
    if (misaligned(w, ws) || misaligned(scales, ss) || (offset && misaligned(offsets, ss)) ||
        misaligned(max_err, sizeof(float)) || misaligned(sqnr_db, sizeof(float)) ||
        misaligned(importance, sizeof(float)))
        return AXL_ERR_MISALIGNED;
    /* numel <= MAX_ELEMENTS: none of these byte counts overflows. */
    const uint64_t q_row = bits == 8 ? (uint64_t)cols : ((uint64_t)cols + 1) / 2;
    const span spans[] = {
        span_of(w, (uint64_t)numel * ws),
        span_of(importance, (uint64_t)cols * sizeof(float)),
        span_of(q, (uint64_t)rows * q_row),
        span_of(scales, (uint64_t)rows * (uint64_t)groups * ss),
        span_of(zero_points, (uint64_t)rows * (uint64_t)groups),
        span_of(offset ? offsets : NULL, (uint64_t)rows * (uint64_t)groups * ss),
        span_of(max_err, (uint64_t)rows * sizeof(float)),
        span_of(sqnr_db, (uint64_t)rows * sizeof(float)),
        span_of(bad_row, sizeof *bad_row),
    };
    const int nspans = (int)(sizeof spans / sizeof *spans);
    for (int i = 2; i < nspans; i++) /* every buffer but w and importance is written */
        for (int j = 0; j < nspans; j++)
            if (i != j && spans_overlap(spans[i], spans[j])) return AXL_ERR_OVERLAP;
    if (importance)
        for (int64_t k = 0; k < cols; k++)
            if (!(importance[k] >= 0 && importance[k] <= FLT_MAX)) return AXL_ERR_BAD_VALUE;

    quant_job job = {
        .fn = quant_kernels[isa][src_dtype],
        .fmt = {cols, block_size, groups, bits, symmetric,
                (int64_t)(rows * q_row) >= AXL_STREAM_MIN_BYTES, scale_dtype, scheme,
                spec->search, importance},
        .rows = rows,
        .workers = worker_count(nthreads, rows, numel),
        .w = w,
        .w_row = (size_t)cols * ws,
        .q = q,
        .q_row = (size_t)q_row,
        .scales = scales,
        .scales_row = (size_t)groups * ss,
        .zp = zero_points,
        .offsets = offset ? offsets : NULL,
        .search = spec->search || offset ? search_ops[isa] : NULL,
        .src_dtype = src_dtype,
        .max_err = max_err,
        .sqnr_db = sqnr_db,
    };
    atomic_init(&job.bad_row, rows);
    if (bad_row) *bad_row = -1;
    status = axl_parallel_for((int64_t)job.workers * WORKER_SPAN, job.workers, WORKER_SPAN,
                              quant_worker, &job);
    if (status != AXL_OK) return status;
    int64_t bad = atomic_load(&job.bad_row);
    if (bad < rows) {
        if (bad_row) *bad_row = bad;
        return AXL_ERR_NON_FINITE;
    }
    return AXL_OK;
}

int axl_quantize(const void *w, int src_dtype, int64_t rows, int64_t cols, int bits,
                 int symmetric, int64_t block_size, void *q, void *scales, int scale_dtype,
                 int8_t *zero_points, float *max_err, float *sqnr_db, int64_t *bad_row,
                 int nthreads, int isa) {
    /* symmetric outside 0/1 is a bad format; scheme -1 says so in the checks' order. */
    const axl_qspec spec = {bits, symmetric == 1 ? AXL_Q_SYMMETRIC : symmetric == 0 ? AXL_Q_ZERO_POINT : -1,
                            block_size, scale_dtype, 0, NULL};
    return axl_quantize_spec(w, src_dtype, rows, cols, &spec, q, scales, zero_points, NULL,
                             max_err, sqnr_db, bad_row, nthreads, isa);
}

/* ---- axl_dequantize ---------------------------------------------------------------------- */

typedef struct dequant_job {
    axl_dequant_row_fn fn;
    axl_qformat fmt;
    int64_t rows;
    int workers;
    const char *q;
    size_t q_row;
    const char *scales;
    size_t scales_row; /* bytes per row of scales (and of offsets) */
    const int8_t *zp;
    const char *offsets; /* AXL_Q_OFFSET: y = q * scale + offset (scalar on every ISA) */
    int dst_dtype;
    char *out;
    size_t out_row; /* bytes per row of out */
} dequant_job;

static void dequant_worker(void *arg, int64_t begin, int64_t end) {
    const dequant_job *job = arg;
    (void)end;
    int64_t r0, r1;
    worker_rows(job->rows, job->workers, begin / WORKER_SPAN, &r0, &r1);
    const int64_t g = job->fmt.groups;
    fp_env env = fp_enter();
    for (int64_t r = r0; r < r1; r++) {
        const char *q = job->q + (size_t)r * job->q_row;
        const char *sc = job->scales + (size_t)r * job->scales_row;
        char *out = job->out + (size_t)r * job->out_row;
        if (job->offsets)
            axl_dequant_row_offset(q, sc, job->offsets + (size_t)r * job->scales_row, &job->fmt,
                                   out, job->dst_dtype);
        else
            job->fn(q, sc, job->zp ? job->zp + r * g : NULL, &job->fmt, out);
    }
    fp_leave(env);
}

int axl_dequantize_spec(const void *q, const void *scales, const int8_t *zero_points,
                        const void *offsets, int64_t rows, int64_t cols, const axl_qspec *spec,
                        void *out, int dst_dtype, int nthreads, int isa) {
    if (!spec) return AXL_ERR_NULL_POINTER;
    const int bits = spec->bits, scale_dtype = spec->scale_dtype, scheme = spec->scheme;
    int64_t block_size = spec->block_size;
    if (!is_float_dtype(dst_dtype) || !is_scale_dtype(scale_dtype)) return AXL_ERR_BAD_DTYPE;
    int64_t numel = 0, groups = 0;
    int status = check_sizes(rows, cols, &numel);
    if (status != AXL_OK) return status;
    if ((bits != 4 && bits != 8) || scheme < 0 || scheme >= AXL_Q_SCHEME_COUNT)
        return AXL_ERR_BAD_FORMAT;
    status = check_block(cols, &block_size, &groups);
    if (status != AXL_OK) return status;
    if (nthreads < 0) return AXL_ERR_BAD_THREADS;
    status = axl_resolve_isa(isa, &isa);
    if (status != AXL_OK) return status;
    if (numel == 0) return AXL_OK;
    const int offset = scheme == AXL_Q_OFFSET;
    if (!q || !scales || !out || (offset && !offsets)) return AXL_ERR_NULL_POINTER;
    if (offset) zero_points = NULL;

    size_t os = axl_dtype_size(dst_dtype), ss = axl_dtype_size(scale_dtype);
    if (misaligned(scales, ss) || misaligned(out, os) || (offset && misaligned(offsets, ss)))
        return AXL_ERR_MISALIGNED;
    const uint64_t q_row = bits == 8 ? (uint64_t)cols : ((uint64_t)cols + 1) / 2;
    const span o = span_of(out, (uint64_t)numel * os);
    if (spans_overlap(o, span_of(q, (uint64_t)rows * q_row)) ||
        spans_overlap(o, span_of(scales, (uint64_t)rows * (uint64_t)groups * ss)) ||
        spans_overlap(o, span_of(zero_points, (uint64_t)rows * (uint64_t)groups)) ||
        spans_overlap(o, span_of(offset ? offsets : NULL, (uint64_t)rows * (uint64_t)groups * ss)))
        return AXL_ERR_OVERLAP;

    dequant_job job = {
        .fn = dequant_kernels[isa][dst_dtype],
        .fmt = {cols, block_size, groups, bits, zero_points == NULL, 0, scale_dtype, scheme, 0,
                NULL},
        .rows = rows,
        .workers = worker_count(nthreads, rows, numel),
        .q = q,
        .q_row = (size_t)q_row,
        .scales = scales,
        .scales_row = (size_t)groups * ss,
        .zp = zero_points,
        .offsets = offset ? offsets : NULL,
        .dst_dtype = dst_dtype,
        .out = out,
        .out_row = (size_t)cols * os,
    };
    return axl_parallel_for((int64_t)job.workers * WORKER_SPAN, job.workers, WORKER_SPAN,
                            dequant_worker, &job);
}

int axl_dequantize(const void *q, const void *scales, int scale_dtype, const int8_t *zero_points,
                   int64_t rows, int64_t cols, int bits, int64_t block_size, void *out,
                   int dst_dtype, int nthreads, int isa) {
    const axl_qspec spec = {bits, zero_points ? AXL_Q_ZERO_POINT : AXL_Q_SYMMETRIC, block_size,
                            scale_dtype, 0, NULL};
    return axl_dequantize_spec(q, scales, zero_points, NULL, rows, cols, &spec, out, dst_dtype,
                               nthreads, isa);
}
