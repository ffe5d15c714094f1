/* test.h - tiny assertion macros shared by the C test files. */
#ifndef AXL_TEST_H
#define AXL_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

extern int axl_tests_passed, axl_tests_failed;

/* Counts one check; on failure prints where, the expression and a printf-style detail. */
#define CHECK_MSG(cond, ...)                                                   \
    do {                                                                       \
        if (cond) {                                                            \
            axl_tests_passed++;                                                \
        } else {                                                               \
            axl_tests_failed++;                                                \
            fprintf(stderr, "%s:%d: FAILED %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                      \
            fputc('\n', stderr);                                               \
        }                                                                      \
    } while (0)

#define CHECK(cond) CHECK_MSG(cond, "%s", "")
#define CHECK_EQ(a, b) \
    CHECK_MSG((long long)(a) == (long long)(b), "%lld != %lld", (long long)(a), (long long)(b))

/* xorshift64*: a fixed-seed generator per test file, so failures reproduce. */
static inline uint32_t axl_test_rng(uint64_t *state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (uint32_t)((*state * 0x2545F4914F6CDD1Du) >> 32);
}

/* malloc that ends the test run (exit 2) rather than returning NULL. */
static inline void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory allocating %zu bytes\n", bytes);
        exit(2);
    }
    return p;
}

/* One entry per test file, called from main() in test_core.c. */
void test_convert(void);
void test_shards(void);
void test_quant(void);
void test_safetensors(void);
void test_fuzz_regressions(void);

/* Makes pthread_create fail from the (after+1)-th call on; after < 0 turns that off.
 * Main thread only (test_core.c wraps pthread_create). */
void axl_test_fail_thread_creates(int after);

#endif /* AXL_TEST_H */
