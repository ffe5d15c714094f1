/* test_fuzz_regressions.c - inputs the fuzz targets (csrc/fuzz/) found wrong answers for,
 * kept as plain tests so that the fixes stay fixed in `make test` and `make sanitize`.
 *
 * 1. fuzz_quantize: an asymmetric 4-bit block with a bf16 scale, holding 0 and
 *    0x1.fefefep+127 (near FLT_MAX): hi - lo is finite, but the scale rounded up to bf16
 *    makes the grid 15 * scale overflow, and the largest element dequantized to +Inf
 *    (|x - y| unbounded, against autoxla.h's scale / 2 bound). Such a block now makes its
 *    row non-finite (AXL_ERR_NON_FINITE, bad_row), on every ISA. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "autoxla.h"
#include "test.h"

void test_fuzz_regressions(void);

static int isa_runs(int isa) {
    uint32_t f = axl_cpu_features();
    uint32_t avx2 = AXL_CPU_AVX2 | AXL_CPU_F16C | AXL_CPU_FMA;
    uint32_t avx512 = avx2 | AXL_CPU_AVX512F | AXL_CPU_AVX512BW | AXL_CPU_AVX512DQ |
                      AXL_CPU_AVX512VL;
    if (isa == AXL_ISA_AVX2) return (f & avx2) == avx2;
    if (isa == AXL_ISA_AVX512) return (f & avx512) == avx512;
    return 1;
}

/* rows x cols f32 (cols <= 256), one block per row, quantized on isa: status and bad_row;
 * when it succeeds, every element dequantized must be finite and within scale / 2 (plus
 * fp32 rounding) of its input. */
static int quantize_block_rows(const float *w, int64_t rows, int64_t cols, int bits,
                               int symmetric, int scale_dtype, int isa, int64_t *bad_row) {
    uint8_t q[4 * 256];
    uint16_t scales[2 * 4]; /* (rows, 1) of up to 4 bytes, rows <= 4 */
    int8_t zp[4];
    float y[4 * 256];
    int st = axl_quantize(w, AXL_F32, rows, cols, bits, symmetric, cols, q, scales, scale_dtype,
                          zp, NULL, NULL, bad_row, 1, isa);
    if (st != AXL_OK) return st;
    CHECK_EQ(axl_dequantize(q, scales, scale_dtype, zp, rows, cols, bits, cols, y, AXL_F32, 1,
                            isa),
             AXL_OK);
    for (int64_t r = 0; r < rows; r++) {
        float scale;
        if (scale_dtype == AXL_F32) {
            memcpy(&scale, (const uint8_t *)scales + 4 * r, 4);
        } else {
            uint32_t b = (uint32_t)scales[r] << 16;
            memcpy(&scale, &b, 4);
        }
        for (int64_t c = 0; c < cols; c++) {
            float x = w[r * cols + c], v = y[r * cols + c];
            CHECK_MSG(isfinite(v) && fabs((double)x - (double)v) <= (double)scale * (0.5 + 0x1p-12),
                      "isa %s row %lld col %lld: x %a dequantized to %a (scale %a)",
                      axl_isa_name(isa), (long long)r, (long long)c, x, v, scale);
        }
    }
    return st;
}

static void test_grid_overflow(void) {
    float w[2 * 32];
    for (int isa = AXL_ISA_SCALAR; isa < AXL_ISA_COUNT; isa++) {
        if (!isa_runs(isa)) continue;
        for (int cols = 2; cols <= 32; cols += 30) { /* per-channel: masked and full vectors */
            /* The fuzzer's block: 0 and 0x1.fefefep+127, asymmetric 4-bit, bf16 scale; row 0
             * is an ordinary row, so bad_row must say 1. */
            for (int k = 0; k < 2 * cols; k++) w[k] = k < cols ? (float)k - 3.0f : 0.0f;
            w[cols + cols - 1] = 0x1.fefefep+127f;
            int64_t bad = -2;
            int st = quantize_block_rows(w, 2, cols, 4, 0, AXL_BF16, isa, &bad);
            CHECK_MSG(st == AXL_ERR_NON_FINITE && bad == 1, "isa %s cols %d: status %d, bad_row %lld",
                      axl_isa_name(isa), cols, st, (long long)bad);

            /* Symmetric 8-bit, bf16 scale, FLT_MAX: 127 * scale overflows too. */
            for (int k = 0; k < cols; k++) w[k] = k % 2 ? FLT_MAX : -1.0f;
            bad = -2;
            st = quantize_block_rows(w, 1, cols, 8, 1, AXL_BF16, isa, &bad);
            CHECK_MSG(st == AXL_ERR_NON_FINITE && bad == 0, "isa %s cols %d: symmetric FLT_MAX: "
                      "status %d, bad_row %lld", axl_isa_name(isa), cols, st, (long long)bad);

            /* Large but representable: 2^127 and -2^126, asymmetric 8-bit, f32 and bf16
             * scales; symmetric 2^127 with an f32 scale. All quantize, and dequantize
             * finite and within the bound (checked in quantize_block_rows). */
            for (int k = 0; k < cols; k++) w[k] = k % 2 ? 0x1p127f : -0x1p126f;
            for (int sd = 0; sd < 2; sd++) {
                bad = -2;
                st = quantize_block_rows(w, 1, cols, 8, 0, sd ? AXL_BF16 : AXL_F32, isa, &bad);
                CHECK_MSG(st == AXL_OK && bad == -1, "isa %s cols %d: 2^127 asymmetric: status %d",
                          axl_isa_name(isa), cols, st);
            }
            bad = -2;
            st = quantize_block_rows(w, 1, cols, 8, 1, AXL_F32, isa, &bad);
            CHECK_MSG(st == AXL_OK && bad == -1, "isa %s cols %d: 2^127 symmetric: status %d",
                      axl_isa_name(isa), cols, st);
        }
    }
}

void test_fuzz_regressions(void) { test_grid_overflow(); }
