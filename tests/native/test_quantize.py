"""AutoXLA._native.quantize / dequantize against the pure-torch reference (tests/reference_quant.py).

Property tests (Hypothesis) over random shapes, odd widths included, the three source dtypes,
every format (8/4 bits x symmetric/asymmetric x per-channel/blocks of 32..1024) and both scale
dtypes (float32, bfloat16; float16 scales: test_quant_formats.py):
  (a) the error bound: every element within half a quantization step of the stored scale
      (plus the named rounding allowances below) of its dequantized value, with either scale
      dtype (a bfloat16 scale is the float32 one rounded up, so the block's range fits);
  (b) the C core equals the reference element for element (q, scale, zero point,
      dequantized values in every dtype; max_err exactly, sqnr_db to float64 rounding);
  (c) every ISA this CPU has equals the scalar one bit for bit, statistics included.
Then golden values, the binding's error cases (each a Python exception, never a crash),
NaN/Inf rows, zero rows, caller buffers, the caller's FP environment, and int8/uint8 through the
shard functions.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from AutoXLA import _native
from tests.reference_quant import (
    QMAX,
    dequantize_reference,
    error_stats_reference,
    quantize_reference,
    unpack_int4,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALE_DTYPES = [torch.float32, torch.bfloat16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
ISAS = _native.available_isas()

# ---- tolerances, with their reasons ------------------------------------------------------
# |x - dequantized| <= scale * (1/2 + SCALE_ROUNDING) + SUBNORMAL_SLACK for a kept block:
# half a step from rounding to the nearest integer, plus the float32 roundings of inv = 1/scale
# and of x * inv (2^-24 relative each, on |x * inv| <= 256 steps: < 2^-15 of a step), of a
# subnormal scale (>= 2^-128, so 2^-21 relative: moves x * inv by < 2^-13 steps... but only
# through inv, bounded above) and of (q - zp) * scale (2^-24 relative on <= 256 steps: 2^-16 of
# a step). 2^-13 of a step covers all of them with margin.
SCALE_ROUNDING = 2.0**-13
# A product (q - zp) * scale in the subnormal range is rounded to a multiple of 2^-149.
SUBNORMAL_SLACK = 2.0**-149
# A bfloat16 scale is the float32 one s rounded UP (the smallest bfloat16 >= s): never
# smaller than s, so the grid of (qmax - qmin) steps still spans the block's range and the
# same bound holds (the analysis above only needs scale >= s; it merely coarsens the grid, by
# up to 2^-8 relative, 2^-5 for the smallest kept scales, bfloat16 subnormals >= 2^-128 (1 +
# 2^-5)). Not a single element is exempt.
# A block whose scale underflows to 0 or whose 1/scale overflows is stored as zeros: that is
# exactly s <= 2^-128, with either scale dtype (a bfloat16 scale rounds up to at least
# 2^-128 (1 + 2^-5) from any s > 2^-128); its elements are below 255 * 2^-128 (1 + 2^-22)
# < 2^-120 in magnitude.
ZERO_BLOCK_MAX = 2.0**-120
# Rounding the float32 dequantized value y to bf16 / f16 adds half an ulp: relative 2^-8 /
# 2^-11, and in the subnormal range an absolute half of the smallest subnormal.
OUT_ROUNDING = {torch.float32: (0.0, 0.0), torch.bfloat16: (2.0**-8, 2.0**-134),
                torch.float16: (2.0**-11, 2.0**-25)}
# sqnr_db: the C core sums in a fixed 16-lane order, the reference with torch's float64 sum;
# the two differ by float64 rounding only, far below float32's 2^-24 of the result.
SQNR_RTOL, SQNR_ATOL = 1e-6, 1e-5
# Quality floor on N(0, 1) weights (torchao checks SQNR > 20 dB on models): int8 per-channel
# gives ~40.8 dB (step 4.2 sigma / 127), int4 in blocks of 32 ~21 dB (step 2.1 sigma / 7).
MIN_SQNR_DB = {(8, -1): 35.0, (4, 32): 17.0}

PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---- random weights ---------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    rows: int
    cols: int
    block_size: int  # -1: per-channel
    bits: int
    symmetric: bool
    dtype: torch.dtype
    pattern: str
    magnitude: int  # log10 of the values' scale
    seed: int
    scale_dtype: torch.dtype = torch.float32

    @property
    def block(self) -> int:
        return self.cols if self.block_size == -1 else self.block_size


PATTERNS = ["normal", "zero_rows", "zero_blocks", "subnormal", "ties", "outlier", "one_sign"]


@st.composite
def cases(draw) -> Case:
    bits = draw(st.sampled_from([8, 4]))
    symmetric = draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    if draw(st.booleans()):  # per-channel, any width
        cols = draw(st.sampled_from([1, 7, 77, 333]) | st.integers(1, 300))
        block_size = draw(st.sampled_from([-1, cols]))
    else:
        block_size = draw(st.sampled_from([32, 64, 96, 128, 256, 1024]))
        cols = block_size * draw(st.integers(1, 2 if block_size == 1024 else 5))
    magnitudes = [-4, -1, 0, 2, 4] if dtype == torch.float16 else [-30, -8, -1, 0, 3, 30]
    return Case(
        rows=draw(st.integers(1, 12)), cols=cols, block_size=block_size, bits=bits,
        symmetric=symmetric, dtype=dtype, pattern=draw(st.sampled_from(PATTERNS)),
        magnitude=draw(st.sampled_from(magnitudes)), seed=draw(st.integers(0, 2**31 - 1)),
        scale_dtype=draw(st.sampled_from(SCALE_DTYPES)),
    )


def make_weight(c: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(c.seed)
    w = torch.randn(c.rows, c.cols, generator=g, dtype=torch.float64)
    w *= 10.0 ** torch.empty(c.rows, 1, dtype=torch.float64).uniform_(-1, 1, generator=g)
    w *= 10.0**c.magnitude
    if c.pattern == "zero_rows":
        w[::2] = 0
    elif c.pattern == "zero_blocks":
        w.view(c.rows, -1, c.block)[:, ::2] = 0
    elif c.pattern == "subnormal":  # subnormals of the dtype (and tiny normals around them)
        w = w / w.abs().max() * (2.0**-16 if c.dtype == torch.float16 else 2.0**-127)
    elif c.pattern == "ties":  # k / 2 with max |x| = qmax: scale 1, x * inv lands on .5
        qmax = QMAX[c.bits]
        w = torch.randint(-2 * qmax, 2 * qmax + 1, (c.rows, c.cols), generator=g) / 2.0
        w[:, 0] = qmax
    elif c.pattern == "outlier":
        w[:, c.cols // 2] *= 1000
    elif c.pattern == "one_sign":
        w = w.abs() * (1 if c.seed % 2 else -1)
    limit = 60000.0 if c.dtype == torch.float16 else 1e37
    return w.clamp(-limit, limit).to(c.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else t


def _first_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (_bits(got) != _bits(want)).nonzero()
    if not bad.numel():
        return ""
    i = tuple(int(v) for v in bad[0])
    return f"{bad.shape[0]} differ; first at {i}: got {got[i].item()!r}, want {want[i].item()!r}"


def assert_same(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    diff = _first_diff(got, want)
    assert not diff, f"{what}: {diff}"


def run(c: Case, w: torch.Tensor, **kw) -> _native.Quantized:
    return _native.quantize(w, bits=c.bits, symmetric=c.symmetric, block_size=c.block_size,
                            scale_dtype=c.scale_dtype, **kw)


def reference(c: Case, w: torch.Tensor, scale_dtype: torch.dtype | None = None):
    return quantize_reference(w, c.bits, c.symmetric, c.block_size,
                              c.scale_dtype if scale_dtype is None else scale_dtype)


def dequant(c: Case, r: _native.Quantized, dtype=torch.float32, **kw) -> torch.Tensor:
    return _native.dequantize(r.q, r.scale, r.zero_point, bits=c.bits, cols=c.cols,
                              block_size=c.block_size, dtype=dtype, **kw)


# ---- (a) the error bound ------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(cases())
def test_error_within_half_a_step(c):
    w = make_weight(c)
    r = run(c, w)
    x = w.to(torch.float64)

    def per_element(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float64).repeat_interleave(c.block, dim=1) if c.cols else x

    scale = per_element(r.scale)
    kept = scale > 0
    # The float32 scale before any rounding to bfloat16 (the reference with float32 scales):
    # a kept bfloat16 scale is the smallest bfloat16 >= it.
    s32 = per_element(reference(c, w, torch.float32)[1])
    if c.scale_dtype == torch.bfloat16:
        below = (r.scale.view(torch.int16).to(torch.int32) - 1).to(torch.int16)
        below = per_element(below.view(torch.bfloat16))
        assert ((s32 <= scale) & ((below < s32) | (scale == s32)))[kept].all(), c
    for dtype in DTYPES:
        y = dequant(c, r, dtype).to(torch.float64)
        rel, absolute = OUT_ROUNDING[dtype]
        bound = scale * (0.5 + SCALE_ROUNDING) + SUBNORMAL_SLACK + y.abs() * rel + absolute
        bound = torch.where(kept, bound, torch.full_like(bound, ZERO_BLOCK_MAX))
        err = (x - y).abs()
        checked = y.abs() <= 65504 if dtype == torch.float16 else torch.ones_like(kept)
        over = (err > bound) & checked
        if over.any():
            i = tuple(int(v) for v in over.nonzero()[0])
            pytest.fail(
                f"{c} -> {dtype}: {int(over.sum())} elements beyond the bound; first at {i}: "
                f"x {x[i].item()!r}, y {y[i].item()!r}, |x - y| {err[i].item():.3e} > "
                f"{bound[i].item():.3e} (scale {scale[i].item():.3e})"
            )
        # Zero blocks hold only values too small for any scale.
        assert (x.abs()[~kept] <= ZERO_BLOCK_MAX).all(), c


# ---- (b) the C core equals the torch reference ------------------------------------------


@PROPERTY_SETTINGS
@given(cases())
def test_equals_reference(c):
    w = make_weight(c)
    r = run(c, w, stats=True)
    q, scale, zp = reference(c, w)
    assert scale.dtype == r.scale.dtype == c.scale_dtype
    assert_same(r.q, q, f"{c} q")
    assert_same(r.scale, scale, f"{c} scale")
    assert_same(r.zero_point, zp, f"{c} zero_point")
    dq = dequantize_reference(q, scale, zp, c.bits, c.cols, c.block_size)
    for dtype in DTYPES:
        want = dequantize_reference(q, scale, zp, c.bits, c.cols, c.block_size, dtype)
        assert_same(dequant(c, r, dtype), want, f"{c} dequantized to {dtype}")
    max_err, sqnr = error_stats_reference(w, dq)
    assert_same(r.max_err, max_err, f"{c} max_err")
    finite = torch.isfinite(sqnr)
    assert torch.equal(torch.isfinite(r.sqnr_db), finite) and torch.equal(
        r.sqnr_db[~finite], sqnr[~finite]), (c, r.sqnr_db, sqnr)
    torch.testing.assert_close(r.sqnr_db[finite], sqnr[finite], rtol=SQNR_RTOL, atol=SQNR_ATOL)


# ---- (c) every ISA equals scalar ---------------------------------------------------------


@PROPERTY_SETTINGS
@given(cases(), st.sampled_from([1, 2, 3, 0]))
def test_every_isa_equals_scalar(c, nthreads):
    w = make_weight(c)
    want = run(c, w, stats=True, isa="scalar", nthreads=1)
    for isa in ISAS:
        got = run(c, w, stats=True, isa=isa, nthreads=nthreads)
        for name in _native.Quantized._fields:
            assert_same(getattr(got, name), getattr(want, name), f"{c} isa {isa} {name}")
        for dtype in DTYPES:
            assert_same(dequant(c, want, dtype, isa=isa, nthreads=nthreads),
                        dequant(c, want, dtype, isa="scalar"), f"{c} isa {isa} -> {dtype}")


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("nthreads", [1, 2, 3, 0])
@pytest.mark.parametrize("bits, symmetric, block_size", [(8, True, -1), (4, False, 64), (4, True, 32)])
def test_threads_agree_on_large_weights(bits, symmetric, block_size, nthreads, scale_dtype):
    """Large enough that the C core splits rows over threads (and streams its stores)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1000, 4096, generator=g).to(torch.bfloat16)
    kw = dict(bits=bits, symmetric=symmetric, block_size=block_size, stats=True,
              scale_dtype=scale_dtype)
    one = _native.quantize(w, nthreads=1, **kw)
    many = _native.quantize(w, nthreads=nthreads, **kw)
    for name in _native.Quantized._fields:
        assert_same(getattr(many, name), getattr(one, name), name)
    q, scale, zp = quantize_reference(w, bits, symmetric, block_size, scale_dtype)
    assert_same(one.q, q, "q")
    assert_same(one.scale, scale, "scale")


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("bits, block_size", sorted(MIN_SQNR_DB))
def test_quality_on_gaussian_weights(bits, block_size, scale_dtype):
    w = torch.randn(256, 4096, generator=torch.Generator().manual_seed(3))
    r = _native.quantize(w, bits=bits, symmetric=True, block_size=block_size, stats=True,
                         scale_dtype=scale_dtype)
    assert float(r.sqnr_db.min()) > MIN_SQNR_DB[(bits, block_size)], r.sqnr_db.min()


# ---- layouts, special values, buffers ------------------------------------------------------


def test_int4_nibble_order_golden_bytes():
    """Element 2j in the low nibble, 2j+1 in the high nibble; an odd row ends in a 0 nibble."""
    w = torch.tensor([[7.0, -7.0, 1.0, -1.0, 3.5], [-3.0, 12.0, 0.0, 2.5, 7.0]])
    sym = _native.quantize(w[:1], bits=4, symmetric=True, block_size=-1)
    assert sym.q.tolist() == [[0x97, 0xF1, 0x04]] and sym.scale.tolist() == [[1.0]]
    asym = _native.quantize(w[1:], bits=4, symmetric=False, block_size=-1)
    assert asym.q.tolist() == [[0x78, 0xDB, 0x02]]
    assert asym.scale.tolist() == [[1.0]] and asym.zero_point.tolist() == [[-5]]
    assert unpack_int4(asym.q, 5).tolist() == [[-8, 7, -5, -3, 2]]


@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_scale_golden_values(isa):
    """The scale is rounded UP to bfloat16 first (not to nearest, as .to(torch.bfloat16)
    would), and that rounded scale is used: worked out by hand (as in csrc/tests/test_quant.c),
    padded to 32 columns too (the same values; zeros quantize to the zero point) for the
    AVX-512 kernel's unmasked path."""
    bf16 = torch.bfloat16
    cases = [
        # int8 symmetric: 100 / 127 = 0x3F4992A5 rounds up to 0x3F4A = 0.7890625, so 50 ->
        # 63.37 -> 63 (the float32 scale gives 63.5 -> 64).
        ([100.0, -37.5, 0.4, 63.0, 50.0], True, 0.7890625, 0, [127, -48, 1, 80, 63]),
        # int8 asymmetric: lo = -255 (1 + 3 * 2^-10), hi 0: the scale 1 + 3 * 2^-10 rounds
        # UP to 1.0078125 (to nearest: down to 1.0, and both clamps would bind), lo * inv =
        # -253.76 -> -254, so zp = -128 + 254 = 126 and lo -> -128; -50.6 -> -50.21 -> 76,
        # -0.625 -> -0.62 -> 125, -100.5 -> -99.72 -> 26.
        ([-255.7470703125, 0.0, -50.6, -0.625, -100.5], False, 1.0078125, 126,
         [-128, 126, 76, 125, 26]),
        # int8 symmetric, a subnormal bfloat16 scale: amax = 132 * 2^-128, s = 33.26 * 2^-133
        # rounds up to 34 * 2^-133 (bits 0x0022): amax * inv = 132 * 32 / 34 = 124.24 -> 124.
        ([132 * 2.0**-128, -132 * 2.0**-128, 66 * 2.0**-128, -33 * 2.0**-128], True,
         34 * 2.0**-133, 0, [124, -124, 62, -31]),
    ]
    for values, symmetric, scale, zp, q in cases:
        for cols in (len(values), 32):
            w = torch.zeros(1, cols)
            w[0, : len(values)] = torch.tensor(values)
            r = _native.quantize(w, bits=8, symmetric=symmetric, block_size=-1, scale_dtype=bf16,
                                 isa=isa)
            assert r.q.tolist() == [q + [zp] * (cols - len(values))], (values, isa)
            assert r.scale.dtype == bf16 and r.scale.float().tolist() == [[scale]]
            assert symmetric or r.zero_point.tolist() == [[zp]]
            want_q, want_scale, want_zp = quantize_reference(w, 8, symmetric, -1, bf16)
            assert_same(r.q, want_q, "q")
            assert_same(r.scale, want_scale, "scale")
            assert_same(r.zero_point, want_zp, "zero_point")
            # Every element within half a step: the range fits the rounded-up scale's grid.
            y = _native.dequantize(r.q, r.scale, r.zero_point, bits=8, cols=cols, block_size=-1)
            assert float((w - y).abs().max()) <= scale / 2, (values, isa)
    assert torch.tensor([34 * 2.0**-133]).to(bf16).view(torch.int16).item() == 0x0022
    # Round to nearest would have given 1.0 and 33 * 2^-133 for the last two.
    assert torch.tensor([1.0029296875, 33.26 * 2.0**-133]).to(bf16).float().tolist() == [
        1.0, 33 * 2.0**-133]


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_zero_rows_and_blocks(scale_dtype):
    w = torch.zeros(3, 128, dtype=torch.bfloat16)
    w[1, 64:] = torch.linspace(-1, 1, 64)
    for bits in (8, 4):
        for symmetric in (True, False):
            r = _native.quantize(w, bits=bits, symmetric=symmetric, block_size=64, stats=True,
                                 scale_dtype=scale_dtype)
            assert r.scale.dtype == scale_dtype
            assert not r.q[0].any() and not r.q[2].any() and not r.q[1, : r.q.shape[1] // 2].any()
            assert r.scale.tolist()[0] == [0.0, 0.0] and r.scale[1, 0] == 0 and r.scale[1, 1] > 0
            assert not torch.signbit(r.scale).any()
            if not symmetric:
                assert r.zero_point[0].tolist() == [0, 0] and r.zero_point[1, 0] == 0
            assert r.max_err[0] == 0 and math.isinf(r.sqnr_db[0]) and r.sqnr_db[0] > 0
            y = _native.dequantize(r.q, r.scale, r.zero_point, bits=bits, cols=128, block_size=64)
            assert not y[0].any() and not y[2].any()


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_empty_weights(scale_dtype):
    for rows, cols in ((0, 64), (3, 0), (0, 0)):
        r = _native.quantize(torch.empty(rows, cols), bits=4, symmetric=False, block_size=-1,
                             stats=True, scale_dtype=scale_dtype)
        assert r.q.shape == _native.quantized_shape(rows, cols, 4) == (rows, (cols + 1) // 2)
        assert r.scale.shape == r.zero_point.shape == (rows, 1 if cols else 0)
        assert r.scale.dtype == scale_dtype
        assert r.max_err.tolist() == [0.0] * rows and r.sqnr_db.tolist() == [math.inf] * rows
        y = _native.dequantize(r.q, r.scale, r.zero_point, bits=4, cols=cols, block_size=-1)
        assert y.shape == (rows, cols)


@pytest.mark.parametrize("nthreads", [1, 2, 0])
@pytest.mark.parametrize("symmetric", [True, False])
def test_nan_and_inf_rows_are_named(nthreads, symmetric):
    w = torch.randn(200, 1000).to(torch.bfloat16)
    w[170, 3] = float("nan")
    w[150, 999] = float("-inf")
    with pytest.raises(_native.NativeError, match=r"row 150 of the weight contains NaN or Inf") as info:
        _native.quantize(w, bits=8, symmetric=symmetric, block_size=-1, nthreads=nthreads)
    assert info.value.row == 150 and info.value.code == 7
    w[150, 999] = 0
    with pytest.raises(_native.NativeError, match=r"row 170 .*column 3: nan") as info:
        _native.quantize(w, bits=4, symmetric=symmetric, block_size=-1, nthreads=nthreads)
    assert info.value.row == 170


def test_asymmetric_range_overflow_is_named():
    w = torch.zeros(4, 64)
    w[2, :2] = torch.tensor([3e38, -3e38])
    with pytest.raises(_native.NativeError, match=r"row 2 .*overflows float32.*symmetric=True") as info:
        _native.quantize(w, bits=8, symmetric=False, block_size=32)
    assert info.value.row == 2
    _native.quantize(w, bits=8, symmetric=True, block_size=32)  # symmetric is fine


def test_native_error_row_defaults_to_none():
    with pytest.raises(_native.NativeError) as info:
        _native._check_status(3, "test")
    assert info.value.row is None


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_out_buffers_are_filled_and_returned(scale_dtype):
    w = torch.randn(6, 96, dtype=torch.float16)
    kw = dict(bits=4, symmetric=False, block_size=32, stats=True, scale_dtype=scale_dtype)
    fresh = _native.quantize(w, **kw)
    out = _native.Quantized(
        torch.empty(6, 48, dtype=torch.uint8), torch.empty(6, 3, dtype=scale_dtype),
        torch.empty(6, 3, dtype=torch.int8), torch.empty(6), torch.empty(6),
    )
    got = _native.quantize(w, out=out, **kw)
    assert all(a is b for a, b in zip(got, out))
    for name in _native.Quantized._fields:
        assert_same(getattr(got, name), getattr(fresh, name), name)
    y = torch.empty(6, 96, dtype=torch.bfloat16)
    assert _native.dequantize(got.q, got.scale, got.zero_point, bits=4, cols=96, block_size=32,
                              dtype=torch.bfloat16, out=y) is y
    assert_same(y, dequantize_reference(got.q, got.scale, got.zero_point, 4, 96, 32,
                                        torch.bfloat16), "dequantized")


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_callers_flush_to_zero_changes_nothing(scale_dtype):
    """torch.set_flush_denormal sets FTZ/DAZ on this thread; the C core runs without them."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 2.0**-127
    kw = dict(bits=8, symmetric=False, block_size=32, stats=True, scale_dtype=scale_dtype)
    want = _native.quantize(w, **kw)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for isa in ISAS:
            got = _native.quantize(w, isa=isa, **kw)
            for name in _native.Quantized._fields:
                assert_same(getattr(got, name), getattr(want, name), f"{isa} {name}")
    finally:
        torch.set_flush_denormal(False)


def test_quantized_shape():
    assert _native.quantized_shape(3, 7, 8) == (3, 7)
    assert _native.quantized_shape(3, 7, 4) == (3, 4)
    assert _native.quantized_shape(0, 0, 4) == (0, 0)


# ---- bad arguments: always a Python exception, never a crash -------------------------------

W = torch.randn(4, 64)
Q8 = _native.quantize(W, bits=8, symmetric=False, block_size=32)
Q4 = _native.quantize(W, bits=4, symmetric=True, block_size=-1)


def _quant(w=W, **kw):
    args = dict(bits=8, symmetric=False, block_size=32)
    args.update(kw)
    return lambda: _native.quantize(w, **args)


def _dequant(q=Q8.q, scale=Q8.scale, zero_point=Q8.zero_point, **kw):
    args = dict(bits=8, cols=64, block_size=32)
    args.update(kw)
    return lambda: _native.dequantize(q, scale, zero_point, **args)


def _out(**kw):
    fields = dict(q=torch.empty(4, 64, dtype=torch.int8), scale=torch.empty(4, 2),
                  zero_point=torch.empty(4, 2, dtype=torch.int8), max_err=None, sqnr_db=None)
    fields.update(kw)
    return _native.Quantized(**fields)


_SHARED = torch.empty(64)
_W_BYTES = torch.randn(4, 64)
_OUT_BUF = torch.empty(4 * 64)

BAD_CALLS = [
    ("w list", _quant(w=[[1.0]]), TypeError, "torch.Tensor"),
    ("w float64", _quant(w=W.double()), ValueError, r"float64.*w\.to\(torch\.bfloat16\)"),
    ("w int8", _quant(w=W.to(torch.int8)), ValueError, "int8"),
    ("w meta", _quant(w=torch.empty(4, 64, device="meta")), ValueError, "meta"),
    ("w sparse", _quant(w=W.to_sparse()), ValueError, "to_dense"),
    ("w transposed", _quant(w=torch.randn(64, 4).t()), ValueError, r"\.contiguous\(\)"),
    ("w 1-D", _quant(w=W.reshape(-1)), ValueError, "2-D"),
    ("w 3-D", _quant(w=W.reshape(2, 2, 64)), ValueError, "2-D"),
    ("w neg view", _quant(w=torch._neg_view(W)), ValueError, "resolve_neg"),
    ("w misaligned", _quant(w=torch.frombuffer(bytearray(4 * 65), dtype=torch.float32, offset=1,
                                               count=64).view(1, 64)), ValueError, "aligned"),
    ("bits 3", _quant(bits=3), ValueError, "bits=3"),
    ("bits 16", _quant(bits=16), ValueError, "bits=16"),
    ("bits float", _quant(bits=8.0), TypeError, "bits"),
    ("bits bool", _quant(bits=True), TypeError, "bits"),
    ("symmetric int", _quant(symmetric=1), TypeError, "symmetric"),
    ("stats str", _quant(stats="yes"), TypeError, "stats"),
    ("block 0", _quant(block_size=0), ValueError, "block_size=0"),
    ("block -2", _quant(block_size=-2), ValueError, "block_size=-2"),
    ("block str", _quant(block_size="32"), TypeError, "block_size"),
    ("nthreads -1", _quant(nthreads=-1), ValueError, "nthreads"),
    ("nthreads float", _quant(nthreads=1.5), TypeError, "nthreads"),
    ("isa unknown", _quant(isa="sse"), ValueError, "isa"),
    ("out tuple", _quant(out=tuple(_out())), TypeError, "Quantized"),
    ("out.q dtype", _quant(out=_out(q=torch.empty(4, 64, dtype=torch.uint8))), ValueError, r"out\.q has dtype"),
    ("out.q small", _quant(out=_out(q=torch.empty(4, 63, dtype=torch.int8))), ValueError, r"out\.q has shape \(4, 63\)"),
    ("out.q 1-D", _quant(out=_out(q=torch.empty(256, dtype=torch.int8))), ValueError, r"out\.q has shape"),
    ("out.q meta", _quant(out=_out(q=torch.empty(4, 64, dtype=torch.int8, device="meta"))), ValueError, "meta"),
    ("out.q strided", _quant(out=_out(q=torch.empty(64, 4, dtype=torch.int8).t())), ValueError, "contiguous"),
    ("out.scale shape", _quant(out=_out(scale=torch.empty(4, 1))), ValueError, r"out\.scale has shape"),
    ("out.scale bf16", _quant(out=_out(scale=torch.empty(4, 2, dtype=torch.bfloat16))), ValueError, r"out\.scale has dtype torch\.bfloat16.*dtype=torch\.float32"),
    ("out.scale f32 for bf16", _quant(scale_dtype=torch.bfloat16, out=_out()), ValueError, r"out\.scale has dtype torch\.float32.*dtype=torch\.bfloat16"),
    ("out.scale f16 for bf16", _quant(scale_dtype=torch.bfloat16, out=_out(scale=torch.empty(4, 2, dtype=torch.float16))), ValueError, r"out\.scale has dtype torch\.float16"),
    ("out.scale bf16 shape", _quant(scale_dtype=torch.bfloat16, out=_out(scale=torch.empty(4, 1, dtype=torch.bfloat16))), ValueError, r"out\.scale has shape"),
    ("out.scale bf16 misaligned", _quant(scale_dtype=torch.bfloat16, out=_out(scale=torch.frombuffer(bytearray(20), dtype=torch.bfloat16, offset=1, count=8).view(4, 2))), ValueError, "aligned"),
    ("scale_dtype float64", _quant(scale_dtype=torch.float64), ValueError, r"scale_dtype=torch\.float64 .*torch\.float32 or torch\.bfloat16 or torch\.float16"),
    ("scale_dtype float64", _quant(scale_dtype=torch.float64), ValueError, r"scale_dtype=torch\.float64 .*torch\.float32 or torch\.bfloat16"),
    ("scale_dtype int8", _quant(scale_dtype=torch.int8), ValueError, r"torch\.float32 or torch\.bfloat16"),
    ("scale_dtype str", _quant(scale_dtype="bfloat16"), ValueError, r"scale_dtype='bfloat16' .*torch\.float32 or torch\.bfloat16"),
    ("scale_dtype None", _quant(scale_dtype=None), ValueError, r"scale_dtype=None .*torch\.float32 or torch\.bfloat16"),
    ("scale_dtype list", _quant(scale_dtype=[torch.float32]), ValueError, r"torch\.float32 or torch\.bfloat16"),
    ("out.scale grad", _quant(out=_out(scale=torch.empty(4, 2, requires_grad=True))), ValueError, "requires grad"),
    ("out.scale misaligned", _quant(out=_out(scale=torch.frombuffer(bytearray(40), dtype=torch.float32, offset=2, count=8).view(4, 2))), ValueError, "aligned"),
    ("out.zero_point None", _quant(out=_out(zero_point=None)), ValueError, r"out\.zero_point"),
    ("out.zero_point for symmetric", _quant(symmetric=True, out=_out()), ValueError, r"out\.zero_point must be None"),
    ("out.max_err missing", _quant(stats=True, out=_out()), ValueError, r"out\.max_err"),
    ("out.max_err unasked", _quant(out=_out(max_err=torch.empty(4))), ValueError, r"out\.max_err"),
    ("out overlaps w", _quant(w=_W_BYTES, out=_out(q=_W_BYTES.view(-1).view(torch.int8)[:256].view(4, 64))), ValueError, "share memory"),
    ("out stats overlap", _quant(stats=True, out=_out(max_err=_SHARED[:4], sqnr_db=_SHARED[2:6])), ValueError, "share memory"),
    ("out scale/max_err overlap", _quant(stats=True, out=_out(scale=_SHARED[:8].view(4, 2), max_err=_SHARED[6:10], sqnr_db=torch.empty(4))), ValueError, "share memory"),
    ("dq q list", _dequant(q=[[1]]), TypeError, "torch.Tensor"),
    ("dq q dtype for bits", _dequant(q=Q8.q, bits=4, cols=128), ValueError, r"q has dtype torch\.int8.*bits=4"),
    ("dq q shape vs cols", _dequant(cols=63), ValueError, "cols"),
    ("dq q meta", _dequant(q=torch.empty(4, 64, dtype=torch.int8, device="meta")), ValueError, "meta"),
    ("dq q 1-D", _dequant(q=Q8.q.reshape(-1)), ValueError, "2-D"),
    ("dq cols negative", _dequant(cols=-1), ValueError, "cols"),
    ("dq cols float", _dequant(cols=64.0), TypeError, "cols"),
    ("dq bits", _dequant(bits=2), ValueError, "bits=2"),
    ("dq scale shape", _dequant(scale=Q8.scale[:2]), ValueError, r"scale has shape"),
    ("dq scale dtype", _dequant(scale=Q8.scale.double()), ValueError, "scale has dtype"),
    ("dq scale float64", _dequant(scale=Q8.scale.double()), ValueError, r"scale has dtype torch\.float64; expected one of torch\.float32, torch\.bfloat16, torch\.float16"),
    ("dq scale int16", _dequant(scale=Q8.scale.to(torch.bfloat16).view(torch.int16)), ValueError, r"scale has dtype torch\.int16"),
    ("dq scale bf16 shape", _dequant(scale=Q8.scale.to(torch.bfloat16)[:3]), ValueError, r"scale has shape"),
    ("dq scale bf16 misaligned", _dequant(scale=torch.frombuffer(bytearray(20), dtype=torch.bfloat16, offset=1, count=8).view(4, 2)), ValueError, "aligned"),
    ("dq out overlaps bf16 scale", _dequant(scale=_OUT_BUF.view(torch.bfloat16)[:8].view(4, 2), out=_OUT_BUF.view(4, 64)), ValueError, "shares memory with scale"),
    ("dq scale strided", _dequant(scale=torch.empty(2, 4).t()), ValueError, "contiguous"),
    ("dq zero_point dtype", _dequant(zero_point=Q8.zero_point.to(torch.uint8)), ValueError, "zero_point has dtype"),
    ("dq zero_point shape", _dequant(zero_point=Q8.zero_point[:3]), ValueError, "zero_point has shape"),
    ("dq block", _dequant(block_size=16), ValueError, r"scale has shape \(4, 2\), expected \(4, 4\)"),
    ("dq block 0", _dequant(block_size=0), ValueError, "block_size=0"),
    ("dq dtype int8", _dequant(dtype=torch.int8), ValueError, "dtype"),
    ("dq dtype str", _dequant(dtype="float32"), TypeError, "dtype"),
    ("dq out shape", _dequant(out=torch.empty(4, 63)), ValueError, r"out has shape"),
    ("dq out dtype", _dequant(out=torch.empty(4, 64, dtype=torch.float16)), ValueError, "out has dtype"),
    ("dq out overlaps q", _dequant(q=_W_BYTES.view(-1).view(torch.int8)[:256].view(4, 64), out=_W_BYTES), ValueError, "shares memory with q"),
    ("dq out overlaps scale", _dequant(scale=_OUT_BUF[:8].view(4, 2), out=_OUT_BUF.view(4, 64)), ValueError, "shares memory with scale"),
    ("dq isa", _dequant(isa="avx1024"), ValueError, "isa"),
    ("dq nthreads", _dequant(nthreads=-3), ValueError, "nthreads"),
    ("shape bits", lambda: _native.quantized_shape(2, 3, 5), ValueError, "bits=5"),
    ("shape rows", lambda: _native.quantized_shape(-1, 3, 8), ValueError, "rows"),
]


@pytest.mark.parametrize("call, error, match", [pytest.param(*c[1:], id=c[0]) for c in BAD_CALLS])
def test_bad_arguments_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_unsupported_isa_is_a_native_error():
    missing = [i for i in ("avx2", "avx512") if i not in ISAS]
    if not missing:
        pytest.skip("this CPU supports every ISA, so none can be refused")
    with pytest.raises(_native.NativeError, match="not support"):
        _native.quantize(W, bits=8, symmetric=True, block_size=-1, isa=missing[-1])


# ---- int8 / uint8 through the shard functions ----------------------------------------------


@pytest.mark.parametrize("grid", [(1, 1), (2, 1), (1, 4), (4, 2)])
def test_scatter_quantized_data(grid):
    w = torch.randn(8, 256)
    for r in (_native.quantize(w, bits=8, symmetric=True, block_size=-1),
              _native.quantize(w, bits=4, symmetric=False, block_size=64)):
        for t in (r.q, r.zero_point):
            if t is None:
                continue
            blocks = _native.scatter_shards(t, grid, t.dtype, nthreads=2)
            want = [c for b in t.chunk(grid[0], 0) for c in b.chunk(grid[1], 1)]
            assert len(blocks) == len(want)
            for got, exp in zip(blocks, want):
                assert got.dtype == t.dtype and torch.equal(got, exp)


def test_read_quantized_data_from_a_file(tmp_path):
    q = _native.quantize(torch.randn(16, 128), bits=4, symmetric=False, block_size=32)
    path = tmp_path / "q.safetensors"
    save_file({"q": q.q, "zp": q.zero_point}, str(path))
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    for name, t in (("q", q.q), ("zp", q.zero_point)):
        begin = 8 + n + header[name]["data_offsets"][0]
        blocks = _native.read_shards(path, begin, t.dtype, tuple(t.shape), (2, 2), t.dtype)
        want = [c for b in t.chunk(2, 0) for c in b.chunk(2, 1)]
        assert all(torch.equal(a, b) for a, b in zip(blocks, want))


@pytest.mark.parametrize("src, dst", [(torch.int8, torch.uint8), (torch.int8, torch.float32),
                                      (torch.float32, torch.int8), (torch.uint8, torch.bfloat16)])
def test_shards_never_convert_integers(src, dst):
    with pytest.raises(ValueError, match="expected one of"):
        _native.scatter_shards(torch.zeros(4, 6, dtype=src), (1, 2), dst)
