/* convert_ref.c - scalar reference dtype conversions: the fallback on every CPU and the
 * oracle the vectorised kernels are tested against. Integer arithmetic only, so FTZ/DAZ
 * or a changed rounding mode cannot alter a result. */
#include "internal.h"

/* f16 bits -> f32 bits; exact. A NaN is quieted and keeps sign and payload (as F16C). */
uint32_t axl_f16_to_f32_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    if (exp == 0x1F) return sign | 0x7F800000u | (man << 13) | (man ? 0x00400000u : 0);
    if (exp != 0) return sign | ((exp + 127 - 15) << 23) | (man << 13);
    if (man == 0) return sign;
    /* Subnormal man * 2^-24: shift the leading one up to the implicit bit. */
    exp = 127 - 14;
    while (!(man & 0x400u)) {
        man <<= 1;
        exp--;
    }
    return sign | (exp << 23) | ((man & 0x3FFu) << 13);
}

/* f32 bits -> f16 bits, round to nearest even. A NaN is quieted and keeps its sign and the
 * top 9 payload bits (as F16C). |x| >= 65520 becomes Inf. */
uint16_t axl_f32_bits_to_f16(uint32_t x) {
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00u | ((ax >> 13) & 0x3FFu);
    if (ax >= 0x477FF000u) return sign | 0x7C00u; /* 65520 is the tie above 65504 */
    if (ax >= 0x38800000u) {                      /* 2^-14: f16 normal range */
        uint32_t r = ax - ((127u - 15u) << 23);    /* rebias the exponent */
        r += 0xFFFu + ((r >> 13) & 1u);            /* a carry may bump the exponent: fine */
        return sign | (uint16_t)(r >> 13);
    }
    if (ax <= 0x33000000u) return sign; /* <= 2^-25: the tie rounds to even zero */
    /* f16 subnormal: the result is |x| / 2^-24 rounded; it may round up to 0x0400. */
    uint32_t exp = ax >> 23; /* 102 .. 112 */
    uint32_t man = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126 - exp; /* 14 .. 24 */
    uint32_t q = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

/* f32 bits -> bf16 bits, round to nearest even; any NaN becomes 0x7FC0 (c10::BFloat16). */
uint16_t axl_f32_bits_to_bf16(uint32_t x) {
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* Typed element access is safe: axl_convert checks that buffers are naturally aligned. */
void axl_convert_f32_bf16_ref(const void *src, void *dst, int64_t n) {
    const uint32_t *s = src;
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = axl_f32_bits_to_bf16(s[i]);
}

void axl_convert_f32_f16_ref(const void *src, void *dst, int64_t n) {
    const uint32_t *s = src;
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = axl_f32_bits_to_f16(s[i]);
}

void axl_convert_bf16_f32_ref(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    uint32_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
}

void axl_convert_bf16_f16_ref(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = axl_f32_bits_to_f16((uint32_t)s[i] << 16);
}

void axl_convert_f16_f32_ref(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    uint32_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = axl_f16_to_f32_bits(s[i]);
}

void axl_convert_f16_bf16_ref(const void *src, void *dst, int64_t n) {
    const uint16_t *s = src;
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = axl_f32_bits_to_bf16(axl_f16_to_f32_bits(s[i]));
}
