/* quant_ref.c - scalar reference quantization and dequantization of one row: the fallback
 * on every CPU and the oracle the vectorised kernels are tested against. Two passes per
 * block: its range (and a NaN/Inf check on the bits), then the values and statistics.
 * quant.c runs these with the default FP environment (round to nearest, no FTZ/DAZ). */
#include "internal.h"

void axl_qstats_finish(const double signal[AXL_QLANES], const double noise[AXL_QLANES],
                       double max_abs_err, float *max_err, float *sqnr_db) {
    double s = signal[0], n = noise[0];
    for (int l = 1; l < AXL_QLANES; l++) {
        s += signal[l];
        n += noise[l];
    }
    if (max_err) *max_err = (float)max_abs_err;
    /* signal == 0 < noise: log10(0) = -Inf. */
    if (sqnr_db) *sqnr_db = n == 0 ? INFINITY : (float)(10.0 * log10(s / n));
}

/* Element k of a row of src_dtype, widened to f32 exactly. */
static inline float load_elem(const void *w, int src_dtype, int64_t k) {
    switch (src_dtype) {
    case AXL_F32: return ((const float *)w)[k];
    case AXL_BF16: return axl_f32_from_bits((uint32_t)((const uint16_t *)w)[k] << 16);
    default: return axl_f32_from_bits(axl_f16_to_f32_bits(((const uint16_t *)w)[k]));
    }
}

/* Block g of a row; see axl_quant_block_ref in internal.h. */
static inline int quant_block(const void *w, int src_dtype, const axl_qformat *f, int64_t g,
                              void *q, void *scales, int8_t *zp, double *signal, double *noise,
                              double *max_abs_err) {
    const int32_t qmax = axl_qmax(f), qmin = axl_qmin(f);
    int8_t *q8 = q;
    uint8_t *q4 = q;
    const int64_t k0 = g * f->block, k1 = axl_block_end(f, g);
    /* Pass 1: the block's range (lo <= 0 <= hi). */
    uint32_t amax = 0;
    float lo = 0, hi = 0;
    for (int64_t k = k0; k < k1; k++) axl_range_add(load_elem(w, src_dtype, k), &amax, &lo, &hi);
    if (amax >= 0x7F800000u) return 1;
    float scale, inv;
    int32_t z = 0;
    if (f->symmetric)
        axl_qparams_sym(axl_f32_from_bits(amax), (float)qmax, f->scale_dtype, &scale, &inv);
    else if (axl_qparams_asym(lo, hi, qmin, qmax, f->scale_dtype, &scale, &inv, &z))
        return 1;
    /* A block whose grid, scale * qmax (symmetric) or scale * (qmax - qmin), overflows
     * fp32 (elements within about 2^-8 of FLT_MAX): its extreme values would dequantize
     * to Inf, so the row is non-finite. */
    if (scale * (float)(f->symmetric ? qmax : qmax - qmin) == INFINITY) return 1;
    axl_scale_store(scales, f->scale_dtype, g, scale);
    if (zp) zp[g] = (int8_t)z;
    /* Pass 2: the values, from cache. */
    for (int64_t k = k0; k < k1; k++) {
        float x = load_elem(w, src_dtype, k);
        int32_t v = axl_qvalue(x, inv, z, qmin, qmax);
        if (f->bits == 8)
            q8[k] = (int8_t)v;
        else if (k & 1)
            q4[k >> 1] |= (uint8_t)((v & 0xF) << 4);
        else
            q4[k >> 1] = (uint8_t)(v & 0xF); /* also clears the high nibble */
        if (signal) {
            const int64_t l = (k - k0) % AXL_QLANES;
            axl_qstats_add(x, axl_dqvalue(v, z, scale), &signal[l], &noise[l], max_abs_err);
        }
    }
    return 0;
}

int axl_quant_block_ref(const void *w, int src_dtype, const axl_qformat *f, int64_t g, void *q,
                        void *scales, int8_t *zp, double *signal, double *noise,
                        double *max_abs_err) {
    return quant_block(w, src_dtype, f, g, q, scales, zp, signal, noise, max_abs_err);
}

/* See axl_quant_row_fn in internal.h. */
static inline int quant_row(const void *w, int src_dtype, const axl_qformat *f, void *q,
                            void *scales, int8_t *zp, float *max_err, float *sqnr_db) {
    const int stats = max_err || sqnr_db;
    double signal[AXL_QLANES] = {0}, noise[AXL_QLANES] = {0}, max_abs_err = 0;
    for (int64_t g = 0; g < f->groups; g++)
        if (quant_block(w, src_dtype, f, g, q, scales, zp, stats ? signal : NULL, noise,
                        &max_abs_err))
            return 1;
    if (stats) axl_qstats_finish(signal, noise, max_abs_err, max_err, sqnr_db);
    return 0;
}

int axl_quant_row_ref_any(const void *w, int src_dtype, const axl_qformat *f, void *q,
                          void *scales, int8_t *zp, float *max_err, float *sqnr_db) {
    return quant_row(w, src_dtype, f, q, scales, zp, max_err, sqnr_db);
}

/* Stores y as element k of a row of dst_dtype, rounded as axl_convert rounds. */
static inline void store_elem(void *out, int dst_dtype, int64_t k, float y) {
    switch (dst_dtype) {
    case AXL_F32: ((float *)out)[k] = y; break;
    case AXL_BF16: ((uint16_t *)out)[k] = axl_f32_bits_to_bf16(axl_bits_of_f32(y)); break;
    default: ((uint16_t *)out)[k] = axl_f32_bits_to_f16(axl_bits_of_f32(y)); break;
    }
}

/* See axl_dequant_row_fn in internal.h. */
static inline void dequant_row(const void *q, const void *scales, const int8_t *zp,
                               const axl_qformat *f, void *out, int dst_dtype) {
    const int8_t *q8 = q;
    const uint8_t *q4 = q;
    for (int64_t g = 0; g < f->groups; g++) {
        const int64_t k0 = g * f->block, k1 = axl_block_end(f, g);
        const float scale = axl_scale_load(scales, f->scale_dtype, g);
        const int32_t z = zp ? zp[g] : 0;
        for (int64_t k = k0; k < k1; k++) {
            int32_t v = f->bits == 8 ? q8[k] : axl_nibble_value((q4[k >> 1] >> (4 * (k & 1))) & 0xFu);
            store_elem(out, dst_dtype, k, axl_dqvalue(v, z, scale));
        }
    }
}

void axl_dequant_row_ref_any(const void *q, const void *scales, const int8_t *zp,
                             const axl_qformat *f, void *out, int dst_dtype) {
    dequant_row(q, scales, zp, f, out, dst_dtype);
}

#define QUANT_REF(name, dtype)                                                             \
    int axl_quant_row_##name##_ref(const void *w, const axl_qformat *f, void *q, void *scales, \
                                   int8_t *zp, float *max_err, float *sqnr_db) {              \
        return quant_row(w, dtype, f, q, scales, zp, max_err, sqnr_db);                       \
    }                                                                                         \
    void axl_dequant_row_##name##_ref(const void *q, const void *scales, const int8_t *zp,    \
                                      const axl_qformat *f, void *out) {                      \
        dequant_row(q, scales, zp, f, out, dtype);                                            \
    }

QUANT_REF(f32, AXL_F32)
QUANT_REF(bf16, AXL_BF16)
QUANT_REF(f16, AXL_F16)
