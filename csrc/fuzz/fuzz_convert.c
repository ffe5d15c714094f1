/* fuzz_convert.c - libFuzzer target for axl_convert (autoxla.h).
 *
 * Input: 4 parameter bytes (fault, dtypes, threads, isa), then the elements' bits (any:
 * NaN, Inf, subnormals), repeated up to 1 << 17 elements when the input asks for more.
 * Checks, each a finding when it fails: the status is one of the conditions the arguments
 * meet (at most one made invalid on purpose; fuzz_util.h); every ISA this CPU has, and a
 * threaded run, give the scalar ISA's bytes; equal dtypes copy; and against conversions
 * written here from the definition: bf16 -> f32 and f16 -> f32 exact, f32 -> bf16 round
 * to nearest even with NaN -> 0x7FC0. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fuzz_util.h"

enum fault { F_DTYPE, F_NEG_N, F_THREADS, F_ISA, F_NULL, F_MISALIGNED, F_OVERLAP, F_NONE };

static uint32_t expected_bits(const uint8_t *src, int from, int to, int64_t i, int *known) {
    *known = 1;
    uint32_t x;
    if (from == AXL_F32) memcpy(&x, src + i * 4, 4);
    else {
        uint16_t h;
        memcpy(&h, src + i * 2, 2);
        x = h;
    }
    if (from == to) return x;
    if (from == AXL_BF16 && to == AXL_F32) return x << 16;
    if (from == AXL_F16 && to == AXL_F32) {
        uint32_t sign = (x & 0x8000u) << 16, e = (x >> 10) & 31, m = x & 1023;
        if (e == 31) return sign | 0x7F800000u | (m ? 0x400000u | m << 13 : 0);
        float mag = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(m | 1024), (int)e - 25);
        uint32_t u;
        memcpy(&u, &mag, 4);
        return sign | u;
    }
    if (from == AXL_F32 && to == AXL_BF16) {
        if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
        uint32_t lsb = (x >> 16) & 1;
        return (x + 0x7FFFu + lsb) >> 16;
    }
    *known = 0;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_input in = {data, size};
    int fault = take(&in) % 16;
    if (fault > F_NONE) fault = F_NONE;
    uint8_t b = take(&in);
    int from = b % 3, to = (b >> 2) % 3;
    int nthreads = take(&in) % 4;
    int isa = take(&in) % 4;
    uint8_t extra = take(&in);
    size_t ss = dtype_size(from), ds = dtype_size(to);
    int64_t n = (int64_t)(in.n / ss);
    if (extra >= 0xF0) n = (int64_t)(extra - 0xEF) * 8191; /* up to 1 << 17: threads */

    uint8_t *src_mem = xmalloc((size_t)n * ss + 1), *dst_mem = xmalloc((size_t)n * ds + 1);
    for (int64_t i = 0; i < n * (int64_t)ss; i++) src_mem[i] = stream_byte(in.p, in.n, (size_t)i);
    const void *src = src_mem;
    void *dst = dst_mem;
    int cfrom = from, cto = to, cthreads = nthreads, cisa = isa;
    int64_t cn = n;
    switch (fault) {
    case F_DTYPE:
        if (extra & 1) cfrom = extra & 2 ? AXL_I8 : -1;
        else cto = extra & 2 ? AXL_U8 : AXL_DTYPE_COUNT;
        break;
    case F_NEG_N: cn = -1 - extra; break;
    case F_THREADS: cthreads = -1 - extra % 4; break;
    case F_ISA: cisa = extra & 1 ? -1 : AXL_ISA_COUNT; break;
    case F_NULL:
        if (extra & 1) src = NULL;
        else dst = NULL;
        break;
    case F_MISALIGNED:
        if (extra & 1) {
            memmove(src_mem + 1, src_mem, (size_t)n * ss);
            src = src_mem + 1;
        } else {
            dst = dst_mem + 1;
        }
        break;
    case F_OVERLAP:
        dst = src_mem;
        if (ds > ss) { /* a larger output: both in one buffer that holds the output */
            free(dst_mem);
            dst_mem = xmalloc((size_t)n * ds + 8);
            memcpy(dst_mem + 2 * (extra % 2), src_mem, (size_t)n * ss);
            src = dst_mem + 2 * (extra % 2); /* src from byte 0 or 2, dst from byte 0 */
            dst = dst_mem;
        }
        break;
    }
    uint32_t mask = 0;
    if (!is_float(cfrom) || !is_float(cto)) mask |= BIT(AXL_ERR_BAD_DTYPE);
    if (cn < 0) mask |= BIT(AXL_ERR_BAD_SIZE);
    if (cthreads < 0) mask |= BIT(AXL_ERR_BAD_THREADS);
    if (!isa_available(cisa)) mask |= BIT(AXL_ERR_UNSUPPORTED_ISA);
    if (!mask && cn > 0) {
        if (!src || !dst) mask |= BIT(AXL_ERR_NULL_POINTER);
        if ((src && (uintptr_t)src % ss) || (dst && (uintptr_t)dst % ds))
            mask |= BIT(AXL_ERR_MISALIGNED);
        if (src && dst && ranges_overlap(src, (size_t)n * ss, dst, (size_t)n * ds))
            mask |= BIT(AXL_ERR_OVERLAP);
    }
    int st = axl_convert(src, cfrom, dst, cto, cn, cthreads, cisa);
    expect_status("axl_convert", st, mask);

    if (fault == F_NONE && n > 0) {
        uint8_t *want = xmalloc((size_t)n * ds);
        st = axl_convert(src, from, want, to, n, 1, AXL_ISA_SCALAR);
        expect_status("axl_convert (scalar)", st, 0);
        for (int64_t i = 0; i < n; i++) {
            int known;
            uint32_t e = expected_bits(src_mem, from, to, i, &known), got = 0;
            if (!known) break;
            memcpy(&got, want + i * (int64_t)ds, ds);
            if (got != e)
                fail("axl_convert %d -> %d element %lld: 0x%x, the definition gives 0x%x", from,
                     to, (long long)i, got, e);
        }
        for (int i = AXL_ISA_SCALAR; i <= AXL_ISA_COUNT; i++) {
            int visa = i == AXL_ISA_COUNT ? AXL_ISA_AUTO : i;
            int vthreads = i == AXL_ISA_COUNT ? 2 : 1;
            if (!isa_available(visa)) continue;
            memset(dst_mem, 0xCD, (size_t)n * ds);
            st = axl_convert(src, from, dst_mem, to, n, vthreads, visa);
            expect_status("axl_convert", st, 0);
            if (memcmp(dst_mem, want, (size_t)n * ds)) {
                int64_t k = 0;
                while (memcmp(dst_mem + k * (int64_t)ds, want + k * (int64_t)ds, ds) == 0) k++;
                fail("axl_convert %d -> %d on %s (%d threads): element %lld differs from scalar",
                     from, to, axl_isa_name(visa), vthreads, (long long)k);
            }
        }
        free(want);
    }
    free(src_mem);
    free(dst_mem);
    return 0;
}
