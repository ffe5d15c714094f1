/* test_core.c - the C test runner: status messages, CPU queries, the parallel-for, and
 * main(), which also runs the other test files. The last line printed is
 * "N passed, N failed"; the exit status is non-zero if anything failed.
 *
 * Built by `make test` with -Wl,--wrap=pthread_create so that thread creation can be
 * made to fail on purpose (see __wrap_pthread_create below). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "parallel.h"
#include "test.h"

int axl_tests_passed, axl_tests_failed;

/* ---- failing pthread_create on demand -------------------------------------------------- */

int __real_pthread_create(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
int __wrap_pthread_create(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

static int creates_before_failure = -1; /* < 0: never fail; set by the main thread only */

int __wrap_pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*fn)(void *),
                          void *arg) {
    if (creates_before_failure == 0) return EAGAIN;
    if (creates_before_failure > 0) creates_before_failure--;
    return __real_pthread_create(t, attr, fn, arg);
}

void axl_test_fail_thread_creates(int after) { creates_before_failure = after; }

/* ---- status codes, names, CPU ---------------------------------------------------------- */

static void test_strerror(void) {
    const char *unknown = axl_strerror(-1);
    CHECK(unknown != NULL && strlen(unknown) > 0);
    for (int code = 0; code < AXL_STATUS_COUNT; code++) {
        const char *msg = axl_strerror(code);
        CHECK_MSG(msg != NULL && strlen(msg) > 0, "code %d", code);
        CHECK_MSG(msg && strcmp(msg, unknown) != 0, "code %d has no message", code);
        for (int other = 0; other < code; other++)
            CHECK_MSG(strcmp(msg, axl_strerror(other)) != 0, "codes %d and %d", code, other);
    }
    const int unknown_codes[] = {AXL_STATUS_COUNT, 1000, -100, INT_MIN, INT_MAX};
    for (size_t i = 0; i < sizeof unknown_codes / sizeof *unknown_codes; i++)
        CHECK(strcmp(axl_strerror(unknown_codes[i]), unknown) == 0);
}

static void test_names_and_version(void) {
    CHECK_EQ(axl_abi_version(), AXL_ABI_VERSION);
    CHECK(strcmp(axl_isa_name(AXL_ISA_AUTO), "auto") == 0);
    CHECK(strcmp(axl_isa_name(AXL_ISA_SCALAR), "scalar") == 0);
    CHECK(strcmp(axl_isa_name(AXL_ISA_AVX2), "avx2") == 0);
    CHECK(strcmp(axl_isa_name(AXL_ISA_AVX512), "avx512") == 0);
    CHECK(strcmp(axl_isa_name(-1), "unknown") == 0);
    CHECK(strcmp(axl_isa_name(AXL_ISA_COUNT), "unknown") == 0);
}

static void test_cpu(void) {
    uint32_t f = axl_cpu_features();
    int best = axl_best_isa();
    CHECK(best >= AXL_ISA_SCALAR && best < AXL_ISA_COUNT);
    if ((f & AXL_NEEDS_AVX512) == AXL_NEEDS_AVX512)
        CHECK_EQ(best, AXL_ISA_AVX512);
    else if ((f & AXL_NEEDS_AVX2) == AXL_NEEDS_AVX2)
        CHECK_EQ(best, AXL_ISA_AVX2);
    else
        CHECK_EQ(best, AXL_ISA_SCALAR);
    int resolved = -1;
    CHECK_EQ(axl_resolve_isa(AXL_ISA_AUTO, &resolved), AXL_OK);
    CHECK_EQ(resolved, best);
    CHECK_EQ(axl_resolve_isa(AXL_ISA_SCALAR, &resolved), AXL_OK);
    CHECK_EQ(axl_resolve_isa(AXL_ISA_COUNT, &resolved), AXL_ERR_UNSUPPORTED_ISA);
    CHECK_EQ(axl_resolve_isa(-1, &resolved), AXL_ERR_UNSUPPORTED_ISA);
    CHECK(axl_num_cpus() >= 1);
    printf("cpu: features 0x%x, best isa %s, %d cpus\n", (unsigned)f, axl_isa_name(best),
           axl_num_cpus());
}

/* ---- parallel-for ---------------------------------------------------------------------- */

typedef struct coverage {
    unsigned char *hits; /* per index: how many ranges covered it */
    atomic_int ranges;
    atomic_int misaligned_starts;
} coverage;

static void cover(void *arg, int64_t begin, int64_t end) {
    coverage *c = arg;
    atomic_fetch_add(&c->ranges, 1);
    if (begin % 64) atomic_fetch_add(&c->misaligned_starts, 1);
    for (int64_t i = begin; i < end; i++) c->hits[i]++; /* ranges are disjoint */
}

static void test_parallel_for(void) {
    const int64_t sizes[] = {0, 1, 63, 64, 65, 1000, 100003};
    const int threads[] = {1, 2, 3, 7, AXL_MAX_THREADS + 5};
    const int64_t min_per_thread[] = {1, 1000};
    unsigned char *hits = malloc(100003);
    CHECK(hits != NULL);
    if (!hits) return;
    for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++)
        for (size_t b = 0; b < sizeof threads / sizeof *threads; b++)
            for (size_t m = 0; m < 2; m++) {
                int64_t n = sizes[a];
                coverage c = {hits, 0, 0};
                memset(hits, 0, (size_t)n);
                int status = axl_parallel_for(n, threads[b], min_per_thread[m], cover, &c);
                CHECK_EQ(status, AXL_OK);
                int64_t wrong = 0;
                for (int64_t i = 0; i < n; i++) wrong += hits[i] != 1;
                CHECK_MSG(wrong == 0, "n=%lld threads=%d: %lld indices not covered once",
                          (long long)n, threads[b], (long long)wrong);
                int max_ranges = (int)(n / min_per_thread[m]);
                if (max_ranges > threads[b]) max_ranges = threads[b];
                if (max_ranges > AXL_MAX_THREADS) max_ranges = AXL_MAX_THREADS;
                if (max_ranges < 1) max_ranges = 1;
                int ranges = atomic_load(&c.ranges);
                CHECK_MSG(ranges <= (n ? max_ranges : 0), "n=%lld threads=%d: %d ranges",
                          (long long)n, threads[b], ranges);
                CHECK_EQ(atomic_load(&c.misaligned_starts), 0);
            }
    free(hits);
}

static void test_thread_failure(void) {
    int64_t n = 1 << 20;
    unsigned char *hits = calloc((size_t)n, 1);
    CHECK(hits != NULL);
    if (!hits) return;
    for (int ok_creates = 0; ok_creates < 3; ok_creates++) {
        coverage c = {hits, 0, 0};
        creates_before_failure = ok_creates;
        CHECK_EQ(axl_parallel_for(n, 4, 1, cover, &c), AXL_ERR_RESOURCE);
        CHECK_EQ(atomic_load(&c.ranges), ok_creates); /* the started threads were joined */
    }
    /* And through the public API: a status, not an abort. */
    float *src = calloc((size_t)n, sizeof *src);
    uint16_t *dst = calloc((size_t)n, sizeof *dst);
    CHECK(src && dst);
    if (src && dst) {
        creates_before_failure = 0;
        CHECK_EQ(axl_convert(src, AXL_F32, dst, AXL_BF16, n, 2, AXL_ISA_AUTO), AXL_ERR_RESOURCE);
        creates_before_failure = -1;
        CHECK_EQ(axl_convert(src, AXL_F32, dst, AXL_BF16, n, 2, AXL_ISA_AUTO), AXL_OK);
    }
    creates_before_failure = -1;
    free(src);
    free(dst);
    free(hits);
}

int main(void) {
    test_strerror();
    test_names_and_version();
    test_cpu();
    test_parallel_for();
    test_thread_failure();
    test_convert();
    test_shards();
    test_quant();
    test_safetensors();
    test_fuzz_regressions();
    printf("%d passed, %d failed\n", axl_tests_passed, axl_tests_failed);
    return axl_tests_failed ? 1 : 0;
}
