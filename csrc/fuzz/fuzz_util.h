/* fuzz_util.h - helpers shared by the libFuzzer targets in csrc/fuzz/ (fuzz_*.c).
 *
 * A target reads its parameters from the front of the input with take() (0 once the input
 * is used up, so every input is valid), keeps the rest as data, and calls the C core only
 * through autoxla.h. Every buffer is allocated at its exact size, so AddressSanitizer
 * reports any access outside it. A wrong answer is a finding like a crash: fail() prints
 * what differed and aborts, which libFuzzer records as a crash with its input.
 *
 * Statuses: a target collects every error condition that its arguments meet, as a mask
 * of (1 << axl_status) bits, and expect_status() accepts AXL_OK only for an empty mask
 * and otherwise any one of the met conditions (which one is reported first is the C
 * core's choice of check order; that it reports one that holds is the contract). */
#ifndef AXL_FUZZ_UTIL_H
#define AXL_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autoxla.h"

typedef struct fuzz_input {
    const uint8_t *p;
    size_t n;
} fuzz_input;

static inline uint8_t take(fuzz_input *in) {
    if (in->n == 0) return 0;
    in->n--;
    return *in->p++;
}

static inline uint16_t take16(fuzz_input *in) {
    uint16_t lo = take(in);
    return (uint16_t)(lo | (uint16_t)take(in) << 8);
}

#define fail(...)                                              \
    do {                                                       \
        fprintf(stderr, "FUZZ FINDING %s:%d: ", __FILE__, __LINE__); \
        fprintf(stderr, __VA_ARGS__);                          \
        fprintf(stderr, "\n");                                 \
        abort();                                               \
    } while (0)

#define BIT(status) (1u << (status))

static inline void expect_status(const char *what, int got, uint32_t mask) {
    if (got < 0 || got >= AXL_STATUS_COUNT)
        fail("%s returned %d, not an axl_status", what, got);
    if (mask == 0 && got != AXL_OK)
        fail("%s returned %d (%s) for valid arguments", what, got, axl_strerror(got));
    if (mask != 0 && !(mask & BIT(got)))
        fail("%s returned %d (%s); expected one of mask 0x%x", what, got, axl_strerror(got),
             mask);
}

/* Exact-size allocation; never NULL (size 0 still gives a distinct pointer that ASan
 * treats as 0 bytes long). Out of memory is the harness's problem, not a finding. */
static inline void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "fuzz harness: out of memory for %zu bytes\n", n);
        exit(1);
    }
    if (n == 0) { /* a 0-byte block: ASan then flags any access at all */
        free(p);
        p = malloc(0);
        if (!p) p = malloc(1);
    }
    return p;
}

/* ISAs this CPU runs (the scalar one always), from the public feature bits. */
static inline int isa_available(int isa) {
    uint32_t f = axl_cpu_features();
    uint32_t avx2 = AXL_CPU_AVX2 | AXL_CPU_F16C | AXL_CPU_FMA;
    uint32_t avx512 = avx2 | AXL_CPU_AVX512F | AXL_CPU_AVX512BW | AXL_CPU_AVX512DQ |
                      AXL_CPU_AVX512VL;
    switch (isa) {
    case AXL_ISA_AUTO:
    case AXL_ISA_SCALAR: return 1;
    case AXL_ISA_AVX2: return (f & avx2) == avx2;
    case AXL_ISA_AVX512: return (f & avx512) == avx512;
    default: return 0;
    }
}

static inline size_t dtype_size(int dtype) {
    switch (dtype) {
    case AXL_F32: return 4;
    case AXL_BF16:
    case AXL_F16: return 2;
    case AXL_I8:
    case AXL_U8: return 1;
    default: return 0;
    }
}

static inline int is_float(int dtype) {
    return dtype == AXL_F32 || dtype == AXL_BF16 || dtype == AXL_F16;
}

/* Byte i of an endless stream made from data (data repeated, each repetition xor'ed with
 * a different value so that long buffers are not periodic); a fixed pattern for no data. */
static inline uint8_t stream_byte(const uint8_t *data, size_t n, size_t i) {
    if (n == 0) return (uint8_t)(i * 37u + 11u);
    return (uint8_t)(data[i % n] ^ (uint8_t)((i / n) * 0x9Du));
}

static inline int ranges_overlap(const void *a, size_t an, const void *b, size_t bn) {
    if (an == 0 || bn == 0) return 0;
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + bn && y < x + an;
}

#endif /* AXL_FUZZ_UTIL_H */
