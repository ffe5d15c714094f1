/* test_convert.c - axl_convert: golden values for the scalar reference, round trips,
 * every vectorised ISA equal to the reference bit for bit (also under FTZ/DAZ, at odd
 * sizes and offsets), thread counts, and bad arguments. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "test.h"

#if AXL_X86
#include <xmmintrin.h> /* _mm_getcsr / _mm_setcsr */
#endif

static const int float_dtypes[] = {AXL_F32, AXL_BF16, AXL_F16};
static const char *const dtype_names[] = {"f32", "bf16", "f16"};

static uint64_t rng_state = 0x9E3779B97F4A7C15u;
static uint32_t rng_u32(void) { return axl_test_rng(&rng_state); }

static uint32_t element(const void *buf, int dtype, int64_t i) {
    return axl_dtype_size(dtype) == 4 ? ((const uint32_t *)buf)[i] : ((const uint16_t *)buf)[i];
}

/* Index of the first differing element, or -1. */
static int64_t first_diff(const void *a, const void *b, int dtype, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (element(a, dtype, i) != element(b, dtype, i)) return i;
    return -1;
}

/* ---- inputs ------------------------------------------------------------------------- */

/* f32 values that stress each conversion: signed zeros, infinities, NaNs with payloads,
 * f32 and f16 subnormals, ties for bf16 and f16 rounding, the f16 overflow boundary. */
static const uint32_t f32_specials[] = {
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,             /* +-0, +-Inf */
    0x7FC00000, 0xFFC00000, 0x7FC00001, 0xFFA12345, 0x7F800001, /* NaNs, quiet and signalling */
    0x7FBFFFFF, 0xFFFFFFFF, 0x7FFFE000, 0x7F802000,
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x007FFFFF, /* f32 subnormals */
    0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000, /* extremes */
    0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, /* bf16 ties around 1 */
    0x3F801000, 0x3F803000, 0x3F801001, 0xBF801000,             /* f16 ties around 1 */
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, /* 65504 .. 65536 */
    0xC77FE000, 0xC77FEFFF, 0xC77FF000, 0x477FD000, 0x477FC000,
    0x33800000, 0x33000000, 0x33000001, 0xB3000000, 0x32FFFFFF, /* 2^-24, 2^-25 */
    0x33C00000, 0x34200000, 0x34000000, 0x33A00000, 0x33E00000, /* f16 subnormal ties */
    0x387FC000, 0x387FE000, 0x387FFFFF, 0x38800000, 0x38801000, /* f16 normal boundary */
    0x38000000, 0x37800000, 0x3880F000, 0xB87FE000, 0x387FF000,
};

/* Fills buf with n source values of dtype: for f16/bf16 all 65536 bit patterns (repeated),
 * for f32 the specials, then a sweep across all exponents, then random bits. */
static void fill_input(void *buf, int dtype, int64_t n) {
    if (dtype != AXL_F32) {
        for (int64_t i = 0; i < n; i++) ((uint16_t *)buf)[i] = (uint16_t)i;
        return;
    }
    uint32_t *p = buf;
    int64_t nspecial = (int64_t)(sizeof f32_specials / sizeof *f32_specials);
    for (int64_t i = 0; i < n; i++) {
        if (i < nspecial)
            p[i] = f32_specials[i];
        else if (i < 2 * nspecial + (1 << 20))
            p[i] = (uint32_t)(i * 4093u); /* a prime stride visits every exponent */
        else
            p[i] = rng_u32();
    }
}

/* ---- golden values: the scalar reference against hand-checked results ---------------- */

typedef struct golden {
    int src_dtype;
    uint32_t in;
    int dst_dtype;
    uint32_t out;
} golden;

static const golden goldens[] = {
    {AXL_F32, 0x3F800000, AXL_BF16, 0x3F80},  /* 1.0 */
    {AXL_F32, 0x3F808000, AXL_BF16, 0x3F80},  /* tie, even stays */
    {AXL_F32, 0x3F818000, AXL_BF16, 0x3F82},  /* tie, odd rounds up */
    {AXL_F32, 0x3F808001, AXL_BF16, 0x3F81},  /* above the tie */
    {AXL_F32, 0x7F7FFFFF, AXL_BF16, 0x7F80},  /* FLT_MAX rounds to Inf */
    {AXL_F32, 0xFF800000, AXL_BF16, 0xFF80},  /* -Inf */
    {AXL_F32, 0xFFA12345, AXL_BF16, 0x7FC0},  /* any NaN -> 0x7FC0 */
    {AXL_F32, 0x7F800001, AXL_BF16, 0x7FC0},  /* would round to Inf without the NaN rule */
    {AXL_F32, 0x00008000, AXL_BF16, 0x0000},  /* subnormal tie to even zero */
    {AXL_F32, 0x00018000, AXL_BF16, 0x0002},  /* subnormal tie up */
    {AXL_F32, 0x80000000, AXL_BF16, 0x8000},  /* -0 */
    {AXL_F32, 0x3F800000, AXL_F16, 0x3C00},   /* 1.0 */
    {AXL_F32, 0x3F801000, AXL_F16, 0x3C00},   /* 1 + 2^-11, tie, even stays */
    {AXL_F32, 0x3F803000, AXL_F16, 0x3C02},   /* 1 + 3*2^-11, tie, odd rounds up */
    {AXL_F32, 0x477FE000, AXL_F16, 0x7BFF},   /* 65504, the largest f16 */
    {AXL_F32, 0x477FEFFF, AXL_F16, 0x7BFF},   /* just below 65520 */
    {AXL_F32, 0x477FF000, AXL_F16, 0x7C00},   /* 65520 rounds to Inf */
    {AXL_F32, 0xC77FF000, AXL_F16, 0xFC00},   /* -65520 */
    {AXL_F32, 0x33800000, AXL_F16, 0x0001},   /* 2^-24, the smallest subnormal */
    {AXL_F32, 0x33000000, AXL_F16, 0x0000},   /* 2^-25, tie to even zero */
    {AXL_F32, 0x33000001, AXL_F16, 0x0001},   /* just above 2^-25 */
    {AXL_F32, 0xB3000000, AXL_F16, 0x8000},   /* -2^-25 -> -0 */
    {AXL_F32, 0x33C00000, AXL_F16, 0x0002},   /* 1.5 * 2^-24, tie up to even */
    {AXL_F32, 0x34200000, AXL_F16, 0x0002},   /* 2.5 * 2^-24, tie down to even */
    {AXL_F32, 0x387FC000, AXL_F16, 0x03FF},   /* the largest subnormal */
    {AXL_F32, 0x387FFFFF, AXL_F16, 0x0400},   /* rounds up into the normal range */
    {AXL_F32, 0x38800000, AXL_F16, 0x0400},   /* 2^-14 */
    {AXL_F32, 0x00000001, AXL_F16, 0x0000},   /* f32 subnormal */
    {AXL_F32, 0x7FC00001, AXL_F16, 0x7E00},   /* NaN: quiet, low payload dropped */
    {AXL_F32, 0xFFA12345, AXL_F16, 0xFF09},   /* NaN: sign and top payload kept */
    {AXL_F32, 0x7F800001, AXL_F16, 0x7E00},
    {AXL_F16, 0x0001, AXL_F32, 0x33800000},   /* subnormals are exact */
    {AXL_F16, 0x8001, AXL_F32, 0xB3800000},
    {AXL_F16, 0x03FF, AXL_F32, 0x387FC000},
    {AXL_F16, 0x0400, AXL_F32, 0x38800000},
    {AXL_F16, 0x7BFF, AXL_F32, 0x477FE000},
    {AXL_F16, 0xFC00, AXL_F32, 0xFF800000},
    {AXL_F16, 0x7E00, AXL_F32, 0x7FC00000},
    {AXL_F16, 0xFD01, AXL_F32, 0xFFE02000},   /* signalling NaN is quieted, payload kept */
    {AXL_BF16, 0xFF81, AXL_F32, 0xFF810000},  /* a plain shift, NaN untouched */
    {AXL_BF16, 0x0001, AXL_F32, 0x00010000},
    {AXL_BF16, 0xFF81, AXL_F16, 0xFE08},      /* via f32 */
    {AXL_BF16, 0x4780, AXL_F16, 0x7C00},      /* 65536 */
    {AXL_BF16, 0x477F, AXL_F16, 0x7BF8},      /* 65280 */
    {AXL_BF16, 0x3380, AXL_F16, 0x0001},      /* 2^-24 */
    {AXL_BF16, 0x3300, AXL_F16, 0x0000},      /* 2^-25 */
    {AXL_F16, 0xFD01, AXL_BF16, 0x7FC0},
    {AXL_F16, 0x3C01, AXL_BF16, 0x3F80},      /* 1 + 2^-10 rounds to 1 */
    {AXL_F16, 0x0001, AXL_BF16, 0x3380},
    {AXL_F16, 0x7BFF, AXL_BF16, 0x4780},      /* 65504 rounds up to 65536 */
};

static void test_goldens(void) {
    for (size_t i = 0; i < sizeof goldens / sizeof *goldens; i++) {
        const golden *g = &goldens[i];
        uint32_t in = g->in, out = 0;
        uint16_t in16 = (uint16_t)g->in, out16 = 0;
        const void *src = g->src_dtype == AXL_F32 ? (const void *)&in : (const void *)&in16;
        void *dst = g->dst_dtype == AXL_F32 ? (void *)&out : (void *)&out16;
        int status = axl_convert(src, g->src_dtype, dst, g->dst_dtype, 1, 1, AXL_ISA_SCALAR);
        uint32_t got = g->dst_dtype == AXL_F32 ? out : out16;
        CHECK_EQ(status, AXL_OK);
        CHECK_MSG(got == g->out, "%s 0x%08x -> %s: got 0x%x, want 0x%x",
                  dtype_names[g->src_dtype], (unsigned)g->in, dtype_names[g->dst_dtype],
                  (unsigned)got, (unsigned)g->out);
    }
}

/* Every non-NaN f16 and bf16 survives a trip through f32; the f32 -> 16-bit direction
 * must give back the exact pattern. */
static void test_round_trips(void) {
    uint16_t *in = xmalloc(65536 * 2), *back = xmalloc(65536 * 2);
    uint32_t *mid = xmalloc(65536 * 4);
    const int halves[] = {AXL_BF16, AXL_F16};
    for (int h = 0; h < 2; h++) {
        int dt = halves[h];
        uint16_t exp_mask = dt == AXL_F16 ? 0x7C00 : 0x7F80;
        fill_input(in, dt, 65536);
        CHECK_EQ(axl_convert(in, dt, mid, AXL_F32, 65536, 1, AXL_ISA_SCALAR), AXL_OK);
        CHECK_EQ(axl_convert(mid, AXL_F32, back, dt, 65536, 1, AXL_ISA_SCALAR), AXL_OK);
        int64_t bad = 0;
        for (int i = 0; i < 65536; i++) {
            int nan = (in[i] & exp_mask) == exp_mask && (in[i] & ~exp_mask & 0x7FFF);
            int mid_nan = (mid[i] & 0x7FFFFFFFu) > 0x7F800000u;
            int back_nan = (back[i] & exp_mask) == exp_mask && (back[i] & ~exp_mask & 0x7FFF);
            if (nan ? !(mid_nan && back_nan) : back[i] != in[i]) bad++;
        }
        CHECK_MSG(bad == 0, "%s: %lld patterns do not round-trip", dtype_names[dt],
                  (long long)bad);
    }
    free(in);
    free(back);
    free(mid);
}

/* ---- vectorised == reference --------------------------------------------------------- */

static int isa_available(int isa) {
    return axl_convert(NULL, AXL_F32, NULL, AXL_F32, 0, 1, isa) == AXL_OK;
}

/* Converts src (n elements) with `isa` and compares with want; also converts sub-ranges at
 * odd offsets and lengths (tails, unaligned vectors) and checks nothing past them is
 * written. Returns 1 if all equal. */
static int matches_reference(const void *src, int sd, const void *want, int dd, int64_t n,
                             int isa, const char *what) {
    size_t ssz = axl_dtype_size(sd), dsz = axl_dtype_size(dd);
    char *got = xmalloc((size_t)(n + 64) * dsz);
    int ok = 1;
    int status = axl_convert(src, sd, got, dd, n, 1, isa);
    int64_t at = status == AXL_OK ? first_diff(got, want, dd, n) : -1;
    CHECK_MSG(status == AXL_OK && at < 0,
              "%s %s->%s status %d, index %lld: in 0x%x got 0x%x want 0x%x",
              what, dtype_names[sd], dtype_names[dd], status, (long long)at,
              at >= 0 ? (unsigned)element(src, sd, at) : 0u,
              at >= 0 ? (unsigned)element(got, dd, at) : 0u,
              at >= 0 ? (unsigned)element(want, dd, at) : 0u);
    ok &= status == AXL_OK && at < 0;

    const int64_t lengths[] = {0, 1, 7, 15, 16, 17, 31, 32, 33, 63, 65, 1000};
    const int64_t offsets[] = {0, 1, 3, 17};
    for (size_t l = 0; l < sizeof lengths / sizeof *lengths; l++)
        for (size_t o = 0; o < sizeof offsets / sizeof *offsets; o++) {
            int64_t len = lengths[l], off = offsets[o];
            if (off + len > n) continue;
            memset(got, 0xA5, (size_t)(len + 64) * dsz);
            status = axl_convert((const char *)src + (size_t)off * ssz, sd, got, dd, len, 1, isa);
            at = first_diff(got, (const char *)want + (size_t)off * dsz, dd, len);
            int64_t spill = 0;
            for (size_t b = (size_t)len * dsz; b < (size_t)(len + 64) * dsz; b++)
                spill += (unsigned char)got[b] != 0xA5;
            CHECK_MSG(status == AXL_OK && at < 0 && spill == 0,
                      "%s %s->%s len %lld off %lld: status %d, first diff %lld, "
                      "%lld bytes past the end",
                      what, dtype_names[sd], dtype_names[dd], (long long)len, (long long)off,
                      status, (long long)at, (long long)spill);
            ok &= status == AXL_OK && at < 0 && spill == 0;
        }
    free(got);
    return ok;
}

/* For every pair: the reference result, then every available vector ISA against it. */
static void test_isas_match_reference(const char *mode) {
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            int sd = float_dtypes[a], dd = float_dtypes[b];
            int64_t n = sd == AXL_F32 ? (int64_t)1 << 21 : 65536 * 2 + 13;
            void *src = xmalloc((size_t)n * axl_dtype_size(sd));
            void *want = xmalloc((size_t)n * axl_dtype_size(dd));
            fill_input(src, sd, n);
            CHECK_EQ(axl_convert(src, sd, want, dd, n, 1, AXL_ISA_SCALAR), AXL_OK);
            if (sd == dd) CHECK(memcmp(src, want, (size_t)n * axl_dtype_size(sd)) == 0);
            for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
                if (!isa_available(isa)) continue;
                char what[64];
                snprintf(what, sizeof what, "%s %s", mode, axl_isa_name(isa));
                matches_reference(src, sd, want, dd, n, isa, what);
            }
            free(src);
            free(want);
        }
}

/* F16C and FP compares follow MXCSR.DAZ; the kernels must not (torch.set_flush_denormal
 * sets it for the whole thread). */
static void test_isas_under_ftz_daz(void) {
#if AXL_X86
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u); /* FTZ | DAZ */
    test_isas_match_reference("ftz/daz");
    _mm_setcsr(csr);
#endif
}

/* ---- threads --------------------------------------------------------------------------- */

static void test_thread_counts(void) {
    const int64_t n = 1000003; /* odd, so every split has tails */
    const int counts[] = {2, 3, 0, 64};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            int sd = float_dtypes[a], dd = float_dtypes[b];
            size_t ssz = axl_dtype_size(sd), dsz = axl_dtype_size(dd);
            int64_t words = (n * (int64_t)ssz + 3) / 4; /* random bits, NaNs included */
            uint32_t *src = xmalloc((size_t)words * 4);
            char *one = xmalloc((size_t)n * dsz), *many = xmalloc((size_t)n * dsz);
            for (int64_t i = 0; i < words; i++) src[i] = rng_u32();
            CHECK_EQ(axl_convert(src, sd, one, dd, n, 1, AXL_ISA_AUTO), AXL_OK);
            for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
                memset(many, 0, (size_t)n * dsz);
                CHECK_EQ(axl_convert(src, sd, many, dd, n, counts[c], AXL_ISA_AUTO), AXL_OK);
                CHECK_MSG(memcmp(one, many, (size_t)n * dsz) == 0, "%s->%s nthreads %d",
                          dtype_names[sd], dtype_names[dd], counts[c]);
            }
            /* The reference split over threads gives the same too. */
            memset(many, 0, (size_t)n * dsz);
            CHECK_EQ(axl_convert(src, sd, many, dd, n, 3, AXL_ISA_SCALAR), AXL_OK);
            CHECK(memcmp(one, many, (size_t)n * dsz) == 0);
            free(src);
            free(one);
            free(many);
        }
}

/* ---- bad arguments --------------------------------------------------------------------- */

static void test_bad_arguments(void) {
    _Alignas(64) char src[256] = {0}, dst[256] = {0};
    const int bad_dtypes[] = {-1, AXL_I8, AXL_U8, AXL_DTYPE_COUNT, 99};
    for (size_t i = 0; i < sizeof bad_dtypes / sizeof *bad_dtypes; i++) {
        CHECK_EQ(axl_convert(src, bad_dtypes[i], dst, AXL_F32, 4, 1, 0), AXL_ERR_BAD_DTYPE);
        CHECK_EQ(axl_convert(src, AXL_F32, dst, bad_dtypes[i], 4, 1, 0), AXL_ERR_BAD_DTYPE);
    }
    CHECK_EQ(axl_convert(src, AXL_F32, dst, AXL_BF16, -1, 1, 0), AXL_ERR_BAD_SIZE);
    CHECK_EQ(axl_convert(src, AXL_F32, dst, AXL_BF16, INT64_MIN, 1, 0), AXL_ERR_BAD_SIZE);
    CHECK_EQ(axl_convert(src, AXL_F32, dst, AXL_BF16, INT64_MAX, 1, 0), AXL_ERR_BAD_SIZE);
    CHECK_EQ(axl_convert(src, AXL_F32, dst, AXL_BF16, 4, -1, 0), AXL_ERR_BAD_THREADS);
    CHECK_EQ(axl_convert(src, AXL_F32, dst, AXL_BF16, 4, INT32_MIN, 0), AXL_ERR_BAD_THREADS);
    const int bad_isas[] = {-1, AXL_ISA_COUNT, 99};
    for (size_t i = 0; i < sizeof bad_isas / sizeof *bad_isas; i++)
        CHECK_EQ(axl_convert(src, AXL_F32, dst, AXL_BF16, 4, 1, bad_isas[i]),
                 AXL_ERR_UNSUPPORTED_ISA);
    uint32_t f = axl_cpu_features();
    int status = axl_convert(src, AXL_F32, dst, AXL_BF16, 4, 1, AXL_ISA_AVX2);
    if ((f & AXL_NEEDS_AVX2) != AXL_NEEDS_AVX2) CHECK_EQ(status, AXL_ERR_UNSUPPORTED_ISA);
    status = axl_convert(src, AXL_F32, dst, AXL_BF16, 4, 1, AXL_ISA_AVX512);
    if ((f & AXL_NEEDS_AVX512) != AXL_NEEDS_AVX512) CHECK_EQ(status, AXL_ERR_UNSUPPORTED_ISA);

    CHECK_EQ(axl_convert(NULL, AXL_F32, dst, AXL_BF16, 4, 1, 0), AXL_ERR_NULL_POINTER);
    CHECK_EQ(axl_convert(src, AXL_F32, NULL, AXL_BF16, 4, 1, 0), AXL_ERR_NULL_POINTER);
    CHECK_EQ(axl_convert(NULL, AXL_F32, NULL, AXL_BF16, 0, 1, 0), AXL_OK); /* empty tensors */
    CHECK_EQ(axl_convert(src, AXL_F32, dst, AXL_BF16, 0, 0, 0), AXL_OK);

    CHECK_EQ(axl_convert(src + 1, AXL_F32, dst, AXL_BF16, 4, 1, 0), AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_convert(src + 2, AXL_F32, dst, AXL_BF16, 4, 1, 0), AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_convert(src, AXL_F32, dst + 1, AXL_BF16, 4, 1, 0), AXL_ERR_MISALIGNED);
    CHECK_EQ(axl_convert(src + 2, AXL_BF16, dst + 4, AXL_F32, 4, 1, 0), AXL_OK);

    CHECK_EQ(axl_convert(src, AXL_F32, src, AXL_F32, 4, 1, 0), AXL_ERR_OVERLAP);
    CHECK_EQ(axl_convert(src, AXL_F32, src + 14, AXL_BF16, 4, 1, 0), AXL_ERR_OVERLAP);
    CHECK_EQ(axl_convert(src + 8, AXL_BF16, src, AXL_F32, 4, 1, 0), AXL_ERR_OVERLAP);
    CHECK_EQ(axl_convert(src, AXL_F32, src + 16, AXL_BF16, 4, 1, 0), AXL_OK); /* adjacent */
    CHECK_EQ(axl_convert(src + 8, AXL_BF16, src + 16, AXL_F32, 4, 1, 0), AXL_OK);
}

void test_convert(void) {
    test_goldens();
    test_round_trips();
    test_isas_match_reference("default");
    test_isas_under_ftz_daz();
    test_thread_counts();
    test_bad_arguments();
}
