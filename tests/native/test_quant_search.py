"""The C core's error-minimising search (quantize(..., search=True, importance=...)) and the
float-offset scheme (offset=True).

The property: on every block the searched result's (importance-weighted) squared error,
computed here in float64 from the dequantized values, is never above the plain (absmax /
min-max) result's. Checked over a seeded loop of random blocks (normal, heavy-tailed, with
planted outliers, one-sign, constant), every scheme, both widths, every scale dtype, ragged
blocks, with and without importance. No tolerance: the C core keeps a searched block only if
its error is below (1 - 2^-30) times the plain one's (computed in double), and the float64
sums here differ from its sums by summation order only, at most n * 2^-53 relative for n
non-negative terms (n <= 4096 here: below 2^-41), so the margin covers it.
Also: every ISA gives the same bits; the search really lowers the error on heavy-tailed
weights; the offset scheme's plain error bound; the new arguments' errors.
"""

from __future__ import annotations

import math

import pytest
import torch

from AutoXLA import _native

ISAS = _native.available_isas()
SCALE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCHEMES = [dict(symmetric=True), dict(symmetric=False), dict(symmetric=False, offset=True)]


def _weight(kind: str, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    if kind == "heavy":  # Student-t with 2 degrees of freedom: heavy tails
        chi = torch.randn(rows, cols, 2, generator=g, dtype=torch.float64).pow(2).sum(-1) / 2
        x = x / chi.sqrt()
    elif kind == "outliers":
        mask = torch.rand(rows, cols, generator=g) < 0.03
        x = torch.where(mask, x * 20, x)
    elif kind == "one_sign":
        x = x.abs() + 0.5
    elif kind == "constant":
        x = torch.full((rows, cols), 0.37, dtype=torch.float64)
    scale = torch.logspace(-3, 2, rows, dtype=torch.float64).unsqueeze(1)
    return (x * scale).float()


def _dequant(r: _native.Quantized, bits: int, cols: int, block: int) -> torch.Tensor:
    return _native.dequantize(r.q, r.scale, r.zero_point, bits=bits, cols=cols, block_size=block,
                              offset=r.offset).double()


def _block_errors(w: torch.Tensor, y: torch.Tensor, block: int, imp: torch.Tensor | None):
    """(rows, G) weighted squared errors in float64, the last block possibly short."""
    rows, cols = w.shape
    e = (w.double() - y).pow(2)
    if imp is not None:
        e = e * imp.double()
    groups = -(-cols // block)
    e = torch.nn.functional.pad(e, (0, groups * block - cols))
    return e.view(rows, groups, block).sum(-1)


CASES = [
    (kind, bits, scheme, sd, block, with_imp)
    for kind in ["normal", "heavy", "outliers", "one_sign", "constant"]
    for bits in [4, 8]
    for scheme in range(3)
    for sd in range(3)
    for block, with_imp in [(32, False), (20, True)]
]


@pytest.mark.parametrize("kind, bits, scheme, sd, block, with_imp", CASES)
def test_search_is_never_worse_than_plain(kind, bits, scheme, sd, block, with_imp):
    g = torch.Generator().manual_seed(hash((kind, bits, scheme, sd, block)) % 2**31)
    rows, cols = 24, 100
    w = _weight(kind, rows, cols, g)
    imp = torch.rand(cols, generator=g) * 3 if with_imp else None
    if with_imp:
        imp[::7] = 0  # zero weights are allowed
    kw = dict(bits=bits, block_size=block, scale_dtype=SCALE_DTYPES[sd], **SCHEMES[scheme])
    plain = _native.quantize(w, **kw)
    searched = _native.quantize(w, search=True, importance=imp, **kw)
    e_plain = _block_errors(w, _dequant(plain, bits, cols, block), block, imp)
    e_search = _block_errors(w, _dequant(searched, bits, cols, block), block, imp)
    worse = e_search > e_plain
    assert not bool(worse.any()), (e_search[worse], e_plain[worse])
    for isa in ISAS:
        got = _native.quantize(w, search=True, importance=imp, isa=isa, nthreads=2, **kw)
        for name in ("q", "scale", "zero_point", "offset"):
            a, b = getattr(got, name), getattr(searched, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                                   b.view(torch.uint8) if b.dtype != torch.uint8 else b), (isa, name)


@pytest.mark.parametrize("scheme", range(3))
def test_search_lowers_the_error_of_heavy_tailed_int4(scheme):
    g = torch.Generator().manual_seed(7 + scheme)
    w = _weight("heavy", 64, 256, g)
    kw = dict(bits=4, block_size=32, **SCHEMES[scheme])
    e = [float(_block_errors(w, _dequant(_native.quantize(w, search=s, **kw), 4, 256, 32), 32,
                             None).sum()) for s in (False, True)]
    # Measured 0.70-0.90 of the plain error on these weights; 0.97 leaves room.
    assert e[1] < 0.97 * e[0], e


def test_importance_steers_the_error():
    g = torch.Generator().manual_seed(3)
    w = _weight("outliers", 32, 64, g)
    imp = torch.ones(64)
    imp[:8] = 100.0  # the first columns matter most
    kw = dict(bits=4, symmetric=True, block_size=64)
    uniform = _dequant(_native.quantize(w, search=True, **kw), 4, 64, 64)
    weighted = _dequant(_native.quantize(w, search=True, importance=imp, **kw), 4, 64, 64)
    err = lambda y: float((w.double() - y)[:, :8].pow(2).sum())  # noqa: E731
    assert err(weighted) <= err(uniform)


@pytest.mark.parametrize("sd", SCALE_DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_offset_scheme_plain_bound(sd, bits):
    g = torch.Generator().manual_seed(bits)
    w = _weight("one_sign", 16, 96, g) + 3.0
    r = _native.quantize(w, bits=bits, symmetric=False, offset=True, block_size=32,
                         scale_dtype=sd)
    assert r.zero_point is None and r.offset.dtype == sd and r.offset.shape == (16, 3)
    y = _dequant(r, bits, 96, 32)
    step = r.scale.double().repeat_interleave(32, dim=1)
    # Half a step plus the offset's rounding to nearest (half an ulp of the offset: at most
    # 2^-8 of it for bfloat16's 8 significant bits, 2^-11 for float16's 11, 2^-24 for float32)
    # plus float32 rounding (2^-13 of a step).
    ulp = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[sd]
    off = r.offset.double().abs().repeat_interleave(32, dim=1)
    bound = step * (0.5 + 2.0**-13) + off * ulp + 1e-30
    assert bool(((w.double() - y).abs() <= bound).all())
    # A constant block is stored as scale 0 and its offset.
    c = _native.quantize(torch.full((2, 32), 1.25), bits=bits, symmetric=False, offset=True,
                         block_size=32, scale_dtype=sd)
    assert float(c.scale.abs().max()) == 0 and torch.equal(_dequant(c, bits, 32, 32),
                                                          torch.full((2, 32), 1.25).double())


def test_offset_out_buffers_and_stats():
    w = torch.randn(4, 64)
    kw = dict(bits=4, symmetric=False, offset=True, block_size=32, stats=True, search=True)
    fresh = _native.quantize(w, **kw)
    out = _native.Quantized(torch.empty(4, 32, dtype=torch.uint8), torch.empty(4, 2), None,
                            torch.empty(4), torch.empty(4), torch.empty(4, 2))
    got = _native.quantize(w, out=out, **kw)
    assert got is out
    for name in _native.Quantized._fields:
        a, b = getattr(got, name), getattr(fresh, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    y = _dequant(got, 4, 64, 32)
    err = (w.double() - y)
    assert math.isclose(float(got.max_err.max()), float(err.abs().max()), rel_tol=1e-6)


def _q(**kw):
    args = dict(bits=4, symmetric=False, block_size=32)
    args.update(kw)
    return lambda: _native.quantize(torch.randn(4, 64), **args)


BAD = [
    ("offset with symmetric", _q(symmetric=True, offset=True), ValueError, "symmetric=False"),
    ("importance without search", _q(importance=torch.ones(64)), ValueError, "search=True"),
    ("importance shape", _q(search=True, importance=torch.ones(63)), ValueError, r"\(64,\)"),
    ("importance dtype", _q(search=True, importance=torch.ones(64, dtype=torch.float64)),
     ValueError, "importance has dtype"),
    ("importance negative", _q(search=True, importance=-torch.ones(64)), ValueError,
     r"importance\[0\] is -1"),
    ("importance nan", _q(search=True, importance=torch.full((64,), math.nan)), ValueError,
     "finite"),
    ("search int", _q(search=1), TypeError, "search"),
    ("offset str", _q(offset="yes"), TypeError, "offset"),
    ("out.offset missing", _q(offset=True, out=_native.Quantized(
        torch.empty(4, 32, dtype=torch.uint8), torch.empty(4, 2), None, None, None)),
     ValueError, "out.offset"),
    ("dq offset and zp", lambda: _native.dequantize(
        torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int8),
        bits=4, cols=64, block_size=32, offset=torch.zeros(4, 2)), ValueError, "both given"),
    ("dq offset dtype", lambda: _native.dequantize(
        torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2), None, bits=4, cols=64,
        block_size=32, offset=torch.zeros(4, 2, dtype=torch.bfloat16)), ValueError,
     "offset has dtype"),
]


@pytest.mark.parametrize("call, error, match", [pytest.param(*c[1:], id=c[0]) for c in BAD])
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_float16_offset_overflow_is_named():
    w = torch.full((2, 32), 70000.0)
    w[1, 3] = 70001.0
    with pytest.raises(_native.NativeError) as e:
        _native.quantize(w, bits=8, symmetric=False, offset=True, block_size=32,
                         scale_dtype=torch.float16)
    assert e.value.row == 0 and e.value.reason == "scale_overflow"
