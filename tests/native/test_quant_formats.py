"""The C core's quantization formats beyond tests/native/test_quantize.py: ragged blocks (a
short last block per row, any block size >= 1).

Ragged blocks are checked against an independent oracle: zeros never change a block's
range (symmetric: max |x|; asymmetric: min(min, 0), max(max, 0)), so a row padded with
zeros to whole blocks must quantize to the same scales, zero points and values on the
original columns.
"""

from __future__ import annotations

import pytest
import torch

from AutoXLA import _native

ISAS = _native.available_isas()


def _pad_to_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    cols = w.shape[1]
    return torch.nn.functional.pad(w, (0, -cols % block))


def _values(r: _native.Quantized, bits: int, cols: int) -> torch.Tensor:
    """q as one int per element (int4 unpacked), the first cols columns."""
    if bits == 8:
        return r.q[:, :cols].to(torch.int32)
    b = r.q.to(torch.int32)
    v = torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[0], -1)
    return ((v ^ 8) - 8)[:, :cols]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("cols, block", [(200, 32), (77, 10), (97, 7), (5, 3), (9, 1), (50, 64)])
def test_ragged_blocks_equal_zero_padded_rows(bits, symmetric, cols, block):
    g = torch.Generator().manual_seed(cols * 131 + block)
    w = torch.randn(6, cols, generator=g).to(torch.bfloat16)
    padded = _pad_to_blocks(w, min(block, cols))
    kw = dict(bits=bits, symmetric=symmetric, block_size=block)
    want = _native.quantize(padded.contiguous(), **kw)
    groups = -(-cols // min(block, cols))
    for isa in ISAS:
        got = _native.quantize(w, isa=isa, stats=True, **kw)
        assert got.scale.shape == (6, groups)
        assert torch.equal(got.scale, want.scale[:, :groups]), isa
        if not symmetric:
            assert torch.equal(got.zero_point, want.zero_point[:, :groups]), isa
        assert torch.equal(_values(got, bits, cols), _values(want, bits, cols)), isa
        if bits == 4 and cols % 2:  # the padding nibble of a ragged row is 0
            assert int((got.q[:, -1] >> 4).abs().sum()) == 0
        y = _native.dequantize(got.q, got.scale, got.zero_point, bits=bits, cols=cols,
                               block_size=block, isa=isa)
        y_padded = _native.dequantize(want.q, want.scale, want.zero_point, bits=bits,
                                      cols=padded.shape[1], block_size=block)
        assert torch.equal(y, y_padded[:, :cols]), isa


def _f16_up(s: torch.Tensor) -> torch.Tensor:
    """float32 scales rounded UP to float16 (the smallest float16 >= s), widened back: round to
    nearest, then one float16 step up where that fell below s."""
    h = s.to(torch.float16)
    below = h.to(torch.float32) < s
    up = torch.nextafter(h, torch.tensor(float("inf"), dtype=torch.float16))
    return torch.where(below, up, h).to(torch.float32)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
def test_float16_scales_round_up(bits, symmetric):
    g = torch.Generator().manual_seed(bits + 2 * symmetric)
    w = (torch.randn(16, 96, generator=g) * torch.logspace(-6, 3, 16).unsqueeze(1)).contiguous()
    kw = dict(bits=bits, symmetric=symmetric, block_size=32, stats=True)
    f32 = _native.quantize(w, **kw)
    for isa in ISAS:
        r = _native.quantize(w, scale_dtype=torch.float16, isa=isa, **kw)
        assert r.scale.dtype == torch.float16
        # The float32 scale rounded up is what is stored (never below it).
        assert torch.equal(r.scale.float(), _f16_up(f32.scale)), isa
        y = _native.dequantize(r.q, r.scale, r.zero_point, bits=bits, cols=96, block_size=32,
                               isa=isa)
        step = r.scale.float().repeat_interleave(32, dim=1)
        # Half a step plus float32 rounding (2^-13 of a step, as in test_quantize.py).
        assert bool(((w - y).abs() <= step * (0.5 + 2.0**-13)).all()), isa


@pytest.mark.parametrize("symmetric", [True, False])
def test_float16_scale_overflow_is_named(symmetric):
    w = torch.ones(3, 64)
    levels = 7 if symmetric else 15
    w[2, 40] = 65505.0 * levels  # a scale just above 65504
    with pytest.raises(_native.NativeError) as e:
        _native.quantize(w, bits=4, symmetric=symmetric, block_size=32,
                         scale_dtype=torch.float16)
    assert e.value.row == 2 and e.value.reason == "scale_overflow"
    assert "float16" in str(e.value) and "columns 32 to 63" in str(e.value)
    w[2, 40] = 65504.0 * levels  # exactly the largest float16 scale
    r = _native.quantize(w, bits=4, symmetric=symmetric, block_size=32, scale_dtype=torch.float16)
    assert float(r.scale[2, 1]) == 65504.0
