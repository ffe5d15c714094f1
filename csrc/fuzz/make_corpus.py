#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets read_shards, quantize and convert into
csrc/fuzz/corpus/<target>/ (the safetensors_header corpus is kept by hand beside them).

Each seed follows its target's input layout (the parameter bytes at the top of
fuzz_<target>.c, then data): valid calls of every dtype pair and layout, the edge cases
(empty tensors, a file cut short, NaN / Inf / subnormal values, tiny blocks, threaded
sizes), and one seed per argument fault. Run: python3 csrc/fuzz/make_corpus.py
(deterministic; rewrites the three directories)."""

import base64
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
F32, BF16, F16, I8, U8 = range(5)


def write(target, seeds):
    d = os.path.join(HERE, "corpus", target)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for name, data in seeds.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(bytes(data))


def pattern(n, seed=1):
    """n bytes of a fixed pseudo-random pattern."""
    out, x = bytearray(), seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(x >> 16 & 0xFF)
    return out


SPECIAL_F32 = [0.0, -0.0, 1.0, -2.5, 1e-45, -1e-40, 1.17549435e-38, 3.4028235e38,
               float("inf"), float("-inf"), float("nan"), 65504.0, 65520.0, 6e-8, 1e-39, 0.1]
SPECIAL_F32_BYTES = b"".join(struct.pack("<f", v) for v in SPECIAL_F32) + \
    struct.pack("<I", 0x7F800001) + struct.pack("<I", 0xFFC12345)  # signalling / negative NaN
SPECIAL_16_BYTES = struct.pack("<16H", 0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x7C00,
                               0xFC00, 0x7C01, 0x7E00, 0xFE00, 0x3C00, 0x7F80, 0xFF81, 0x0080,
                               0x3F80)


# ---- read_shards: fault, src, dst byte, ndim, shape[8], grid[8], offset, file mode,
# threads, isa, scratch mode, extra, file bytes.  Shape bytes: 0xFF = 0, 0xF0 + k = a long
# dim of 1 + 4099 k, else 1 + b % 16.  Grid bytes pick a divisor.  File mode 1 = exactly
# as long as needed, 2 = cut short, 3 = longer, 0 = the data as given.
NONE_RS = 31


def rs(fault, src, dst_byte, shape, grid, offset=0, file_mode=1, threads=1, isa=0,
       scratch_mode=0, extra=0, data=b""):
    shape = list(shape) + [0] * (8 - len(shape))
    grid = list(grid) + [0] * (8 - len(grid))
    ndim = len([s for s in shape if s]) or 1
    return bytes([fault, src, dst_byte, ndim - 1] + shape + grid +
                 [offset, file_mode, threads, isa, scratch_mode, extra]) + bytes(data)


def read_shards_seeds():
    s = {}
    d = pattern(200)
    # copies (dst = src: the 0x80 bit) and every float pair
    s["f32_copy_4x6_grid2x3"] = rs(NONE_RS, F32, 0x80, [3, 5], [1, 3], data=d)
    s["i8_copy_3d"] = rs(NONE_RS, I8, 0x80, [1, 2, 3], [1, 1, 2], data=d)
    s["u8_copy_8d"] = rs(NONE_RS, U8, 0x80, [1, 1, 1, 1, 1, 1, 1, 3], [0, 1, 0, 1, 0, 1, 0, 1], data=d)
    for a, an in ((F32, "f32"), (BF16, "bf16"), (F16, "f16")):
        for b, bn in ((F32, "f32"), (BF16, "bf16"), (F16, "f16")):
            s[f"{an}_to_{bn}"] = rs(NONE_RS, a, b, [7, 15], [1, 2], offset=3, data=d)
    s["f32_specials_to_f16"] = rs(NONE_RS, F32, F16, [17], [0], data=SPECIAL_F32_BYTES)
    s["f16_specials_to_bf16"] = rs(NONE_RS, F16, BF16, [15], [1], data=SPECIAL_16_BYTES)
    s["long_dim_bf16_to_f32"] = rs(NONE_RS, BF16, F32, [0xF3], [5], threads=2, data=d)
    s["long_2d_f32_threads"] = rs(NONE_RS, F32, BF16, [0xF8, 3], [3, 1], threads=0, data=d)
    s["empty_tensor"] = rs(NONE_RS, F32, F16, [3, 0xFF], [1, 2], data=d)
    s["file_short"] = rs(NONE_RS, F16, F32, [5, 5], [1, 1], file_mode=2, extra=3, data=d)
    s["file_as_given"] = rs(NONE_RS, F32, 0x80, [3, 3], [1, 1], file_mode=0, data=d[:20])
    s["file_longer"] = rs(NONE_RS, BF16, BF16 | 0x80, [4, 4, 4], [1, 3, 1], file_mode=3, extra=5, data=d)
    s["scratch_minimal"] = rs(NONE_RS, F32, F32 | 0x80, [9, 4], [2, 1], scratch_mode=1, data=d)
    s["scratch_too_small"] = rs(NONE_RS, F32, F32 | 0x80, [9, 4], [2, 1], scratch_mode=3, data=d)
    s["scratch_extra"] = rs(NONE_RS, F16, F32, [9, 4], [2, 1], scratch_mode=2, extra=9, data=d)
    s["isa_scalar"] = rs(NONE_RS, F32, BF16, [6, 6], [1, 3], isa=1, data=d)
    s["isa_avx2"] = rs(NONE_RS, F32, F16, [6, 6], [1, 3], isa=2, data=d)
    s["isa_avx512"] = rs(NONE_RS, BF16, F16, [6, 6], [1, 3], isa=3, data=d)
    s["many_blocks"] = rs(NONE_RS, F32, F32 | 0x80, [15, 15, 15], [3, 3, 3], data=d)
    for fault in range(18):  # every F_* of fuzz_read_shards.c
        s[f"fault_{fault:02d}"] = rs(fault, F32, F16, [3, 7], [1, 1], extra=fault * 7 + 1, data=d)
    return s


# ---- quantize: fault, b1 = src | scale bf16 << 2 | 4-bit << 3 | symmetric << 4 |
# stats << 5 | bad_row << 7, b2 = zp | dst << 1 | value mode << 3 | threads << 5, base
# exponent, rows byte, cols (16 bits: 0x8000 = blockwise, block 32 (1 + (c & 7)),
# 1 + (c >> 3 & 7) blocks; else per-channel cols = c % 1200), isa, extra, element bits.
NONE_Q = 39


def qz(fault, src, scale_bf16, bits4, sym, stats, bad, zp, dst, mode, threads, base, rows,
       cols16, isa=0, extra=0, data=b""):
    b1 = src | scale_bf16 << 2 | bits4 << 3 | sym << 4 | stats << 5 | bad << 7
    b2 = zp | dst << 1 | mode << 3 | threads << 5
    return bytes([fault, b1, b2, base, rows]) + struct.pack("<H", cols16) + \
        bytes([isa, extra]) + bytes(data)


def quantize_seeds():
    s = {}
    d = pattern(600, 7)
    blockwise = lambda block, groups: 0x8000 | (block // 32 - 1) | (groups - 1) << 3
    s["f32_sym8_block32x2"] = qz(NONE_Q, F32, 0, 0, 1, 3, 1, 1, F32, 1, 1, 125, 4, blockwise(32, 2), data=d)
    s["f32_asym4_percol_odd"] = qz(NONE_Q, F32, 0, 1, 0, 3, 1, 1, BF16, 1, 1, 125, 3, 37, data=d)
    s["bf16_asym8_bf16scale"] = qz(NONE_Q, BF16, 1, 0, 0, 1, 0, 1, F16, 2, 1, 120, 5, blockwise(64, 3), data=d)
    s["f16_sym4_bf16scale"] = qz(NONE_Q, F16, 1, 1, 1, 2, 1, 0, F32, 1, 1, 12, 2, blockwise(128, 1), data=d)
    s["f16_percol_wide"] = qz(NONE_Q, F16, 0, 0, 0, 3, 1, 1, F32, 2, 2, 14, 2, 1000, data=d)
    s["raw_bits_nan_inf"] = qz(NONE_Q, F32, 0, 0, 0, 3, 1, 1, F32, 0, 1, 0, 2, 18, data=SPECIAL_F32_BYTES)
    s["raw_16bit_specials"] = qz(NONE_Q, F16, 1, 1, 1, 3, 1, 1, BF16, 0, 1, 0, 1, 16, data=SPECIAL_16_BYTES)
    s["tiny_blocks_near_2m128"] = qz(NONE_Q, F32, 1, 0, 0, 3, 1, 1, F32, 3, 1, 0, 4, blockwise(32, 2), data=d)
    s["subnormal_f32"] = qz(NONE_Q, F32, 0, 1, 1, 3, 1, 1, F32, 3, 1, 0, 3, 64, data=d)
    s["huge_range_asym"] = qz(NONE_Q, F32, 0, 0, 0, 3, 1, 1, F32, 1, 1, 252, 3, 64, data=d)
    s["bf16_huge_range"] = qz(NONE_Q, BF16, 0, 1, 0, 3, 1, 1, F16, 2, 1, 250, 2, blockwise(32, 4), data=d)
    s["threaded_rows"] = qz(NONE_Q, BF16, 0, 0, 1, 3, 1, 1, BF16, 1, 0, 127, 0xFA, blockwise(256, 2), data=d)
    s["empty_cols"] = qz(NONE_Q, F32, 0, 0, 0, 3, 1, 1, F32, 1, 1, 127, 3, 0, data=d)
    s["empty_rows"] = qz(NONE_Q, F32, 0, 1, 0, 3, 1, 1, F32, 1, 1, 127, 0, 40, data=d)
    s["isa_scalar"] = qz(NONE_Q, F32, 0, 0, 0, 3, 1, 1, F32, 1, 1, 127, 4, 96, isa=1, data=d)
    s["isa_avx2"] = qz(NONE_Q, F16, 1, 1, 0, 3, 1, 1, F16, 1, 1, 14, 4, 33, isa=2, data=d)
    s["isa_avx512"] = qz(NONE_Q, BF16, 0, 1, 1, 3, 1, 1, F32, 1, 1, 127, 4, blockwise(96, 2), isa=3, data=d)
    s["raw_dequantize"] = qz(NONE_Q, F32, 1, 1, 0, 0, 0, 1, F16, 1, 1, 127, 3, 35, extra=0x0E, data=d)
    s["bad_dequantize"] = qz(NONE_Q, F32, 0, 0, 0, 0, 0, 1, F32, 1, 1, 127, 3, 35, extra=0x71, data=d)
    s["overlap_dequantize"] = qz(NONE_Q, F32, 0, 0, 0, 0, 0, 1, F32, 1, 1, 127, 3, 35, extra=0xF0, data=d)
    # found by the fuzzer: a bf16-scaled asymmetric 4-bit block holding 0x1.fefefep+127,
    # whose grid overflowed (tests/test_fuzz_regressions.c)
    s["found_grid_overflow"] = base64.b64decode(
        "4QwAPQ8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8P"
        "Dw8PDw8PDw8PDw8PDw8PDw8PDw8PDw8PDxYMAA==")
    for fault in range(19):  # every F_* of fuzz_quantize.c
        s[f"fault_{fault:02d}"] = qz(fault, F32, 0, 0, 0, 3, 1, 1, F32, 1, 1, 127, 3, 64,
                                     extra=fault * 5 + 2, data=d)
    return s


# ---- convert: fault, from | to << 2, threads, isa, extra (>= 0xF0: a long array), bits.
NONE_C = 15


def convert_seeds():
    s = {}
    names = {F32: "f32", BF16: "bf16", F16: "f16"}
    for a in names:
        for b in names:
            data = SPECIAL_F32_BYTES if a == F32 else SPECIAL_16_BYTES
            s[f"{names[a]}_to_{names[b]}_specials"] = bytes([NONE_C, a | b << 2, 1, 0, 0]) + data
    s["f32_to_bf16_long_threads"] = bytes([NONE_C, F32 | BF16 << 2, 2, 0, 0xFF]) + pattern(64)
    s["f16_to_f32_long"] = bytes([NONE_C, F16 | F32 << 2, 0, 3, 0xF8]) + pattern(64, 3)
    s["bf16_to_f16_avx2"] = bytes([NONE_C, BF16 | F16 << 2, 1, 2, 0]) + pattern(200, 5)
    # found by the fuzzer (a harness fault: f16 -> f32 in one shared buffer)
    s["found_overlap_widening"] = base64.b64decode("VtoF/90Fyv8I")
    for fault in range(7):  # every F_* of fuzz_convert.c
        s[f"fault_{fault}"] = bytes([fault, F32 | F16 << 2, 1, 0, fault * 3 + 1]) + pattern(40)
    return s


if __name__ == "__main__":
    write("read_shards", read_shards_seeds())
    write("quantize", quantize_seeds())
    write("convert", convert_seeds())
