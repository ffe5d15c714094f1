"""A pure-torch reference of the C core's quantization (axl_quantize in csrc/include/autoxla.h).

Slow but plain: vectorised torch ops over the whole weight (no Python loop over elements),
doing the same float32 operations in the same order as the C kernels, so that it equals
AutoXLA._native.quantize / dequantize element for element:

    x     = w widened to float32 (exact), viewed as (rows, G, block)
    sym:  amax = max |x|;  scale = amax / qmax                     qmax = 127 or 7
    asym: lo = min(min x, 0), hi = max(max x, 0)
          scale = (hi - lo) / (qmax - qmin)                        qmin, qmax = -128, 127 / -8, 7
    scale = scale rounded UP to bfloat16 (toward +inf: the smallest bfloat16 >= scale, by
          bit manipulation, see _round_up_to_bfloat16) and widened back, when the scales are
          stored as bfloat16 (what the C core does); this rounded scale is used from here on
    inv   = 1 / scale; a block with scale 0 or inv = +inf is all zeros: scale 0, zp 0, q 0
    zp    = clamp(qmin - round(lo * inv), qmin, qmax)              (asym; 0 when symmetric)
    q     = clamp(round(x * inv) + zp, qmin, qmax)                 round = half to even
    y     = float32(q - zp) * float32(scale), then .to(dtype)

Every division, product and difference is a single float32 tensor op between two tensors,
so torch computes it with one IEEE rounding (no fused multiply-add, no reciprocal
shortcut for scalar divisors). Packing for 4 bits: element 2j of a row in the low nibble of
byte j, element 2j+1 in the high nibble, two's complement; odd rows end in a 0 nibble.

Import it as ``from tests.reference_quant import quantize_reference`` (tests/ is a package).
"""

from __future__ import annotations

import torch

__all__ = [
    "QMAX",
    "dequantize_reference",
    "error_stats_reference",
    "pack_int4",
    "q_range",
    "quantize_reference",
    "unpack_int4",
]

QMAX = {8: 127, 4: 7}


def q_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """(qmin, qmax) of the stored integers."""
    qmax = QMAX[bits]
    return (-qmax if symmetric else -qmax - 1), qmax


def _block(cols: int, block_size: int) -> int:
    return cols if block_size in (-1, cols) else block_size


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(rows, cols) integers in [-8, 7] -> (rows, ceil(cols / 2)) uint8 nibble pairs."""
    rows, cols = q.shape
    q = q.to(torch.int32) & 0xF
    if cols % 2:
        q = torch.cat([q, torch.zeros(rows, 1, dtype=torch.int32)], dim=1)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """(rows, ceil(cols / 2)) uint8 nibble pairs -> (rows, cols) int32 in [-8, 7]."""
    b = packed.to(torch.int32)
    nibbles = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(packed.shape[0], -1)[:, :cols]
    return (nibbles ^ 8) - 8


def _round_up_to_bfloat16(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales (finite, >= 0) rounded up to bfloat16 values, still float32: the
    smallest bfloat16 >= each (a bfloat16 value, 0 included, unchanged). For x >= 0 adding
    0xFFFF to the bits carries into the kept high 16 exactly when a dropped bit is set, for
    normal and subnormal x alike; scales are at most FLT_MAX / 7, so no carry reaches Inf."""
    bits = scale.view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def quantize_reference(
    w: torch.Tensor,
    bits: int,
    symmetric: bool,
    block_size: int,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, scale, zero_point) of the 2-D weight w, laid out as _native.quantize returns them
    (q packed for 4 bits; scale of scale_dtype, float32 or bfloat16; zero_point None when
    symmetric). Raises ValueError naming the first row with NaN/Inf, or (asymmetric) whose
    block range overflows float32."""
    if scale_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"scale_dtype {scale_dtype} is not float32 or bfloat16")
    rows, cols = w.shape
    block = _block(cols, block_size)
    groups = cols // block if cols else 0
    qmin, qmax = q_range(bits, symmetric)
    if cols == 0:
        q = torch.zeros((rows, 0), dtype=torch.int8 if bits == 8 else torch.uint8)
        return (q, torch.zeros(rows, 0, dtype=scale_dtype),
                None if symmetric else torch.zeros(rows, 0, dtype=torch.int8))
    x = w.to(torch.float32).reshape(rows, groups, block)
    finite = torch.isfinite(x).flatten(1).all(dim=1)
    if not finite.all():
        raise ValueError(f"row {int((~finite).nonzero()[0])} holds NaN or Inf")

    if symmetric:
        amax = x.abs().amax(dim=-1)
        scale = amax / torch.full_like(amax, float(qmax))
        lo = torch.zeros_like(scale)
    else:
        lo = x.amin(dim=-1).clamp(max=0)
        hi = x.amax(dim=-1).clamp(min=0)
        scale = (hi - lo) / torch.full_like(lo, float(qmax - qmin))
        overflow = torch.isinf(scale).any(dim=1)
        if overflow.any():
            raise ValueError(f"row {int(overflow.nonzero()[0])}: a block range overflows float32")
    # The stored scale, and the one used from here on (finite, >= 0: no NaN rule matters).
    if scale_dtype == torch.bfloat16:
        scale = _round_up_to_bfloat16(scale)
    inv = torch.ones_like(scale) / scale  # 1 / 0 = inf
    zero = torch.isinf(inv)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    inv = torch.where(zero, torch.zeros_like(inv), inv)

    if symmetric:
        zp = torch.zeros(rows, groups, dtype=torch.int32)
    else:
        zp = (qmin - torch.round(lo * inv).to(torch.int32)).clamp(qmin, qmax)
        zp = torch.where(zero, torch.zeros_like(zp), zp)
    v = torch.round(x * inv.unsqueeze(-1)).to(torch.int32)
    q = (v + zp.unsqueeze(-1)).clamp(qmin, qmax).reshape(rows, cols)
    q = q.to(torch.int8) if bits == 8 else pack_int4(q)
    return q, scale.to(scale_dtype), (None if symmetric else zp.to(torch.int8))


def dequantize_reference(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    cols: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """float32(q - zero_point) * scale (a bfloat16 scale widened exactly), rounded to dtype:
    the (rows, cols) weight back."""
    rows = q.shape[0]
    block = _block(cols, block_size)
    groups = cols // block if cols else 0
    v = q.to(torch.int32) if bits == 8 else unpack_int4(q, cols)
    zp = torch.zeros(rows, groups, dtype=torch.int32) if zero_point is None else zero_point.to(torch.int32)
    d = (v.reshape(rows, groups, block) - zp.unsqueeze(-1)).to(torch.float32)
    y = d * scale.to(torch.float32).unsqueeze(-1)
    return y.reshape(rows, cols).to(dtype)


def error_stats_reference(w: torch.Tensor, dq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_err, sqnr_db) per row in float64, from w and its float32 dequantized values.

    max_err = max |x - dq| equals the C core's exactly (a max does not depend on order);
    sqnr_db = 10 log10(sum x^2 / sum (x - dq)^2) differs from the C core's fixed 16-lane sum
    only by float64 rounding (relative ~1e-15 before the final rounding to float32).
    """
    x = w.to(torch.float64)
    e = x - dq.to(torch.float64)
    rows = w.shape[0]
    if w.shape[1] == 0:
        return torch.zeros(rows), torch.full((rows,), float("inf"))
    max_err = e.abs().amax(dim=1).to(torch.float32)
    signal, noise = (x * x).sum(dim=1), (e * e).sum(dim=1)
    sqnr = torch.where(noise == 0, torch.full_like(noise, float("inf")), 10 * torch.log10(signal / noise))
    return max_err, sqnr.to(torch.float32)


def quantized_reference(ref, model):
    """``ref`` (plain transformers, fp32) with every weight ``model`` holds quantized replaced by
    its round trip through tests/reference_quant.py: a linear's (out, in) rows, and an expert
    projection's [experts, out, in] rows (gpt-oss keeps [experts, in, out]: transposed for it)."""
    from AutoXLA.quantization.experts import QuantizedExperts
    from AutoXLA.quantization.linear import QuantizedLinear

    quantized = {n: m for n, m in model.named_modules()
                 if isinstance(m, (QuantizedLinear, QuantizedExperts))}
    assert quantized
    with torch.no_grad():
        for n, m in quantized.items():
            fmt = m.quant_format
            assert not (fmt.search or fmt.offset or fmt.ragged)
            if isinstance(m, QuantizedLinear):
                weight = ref.get_submodule(n).weight
            else:
                owner, _, leaf = n.rpartition(".")
                weight = getattr(ref.get_submodule(owner), leaf)
            # gpt-oss's experts [E, in, out], a Conv1D's (in, out): transposed views
            rows = weight.transpose(-2, -1) if getattr(m, "source_transposed", False) else weight
            shape = rows.shape
            q, scale, zp = quantize_reference(rows.reshape(-1, shape[-1]), fmt.bits, fmt.symmetric,
                                              fmt.block_size, fmt.torch_scale_dtype)
            back = dequantize_reference(q, scale, zp, fmt.bits, fmt.in_features,
                                        fmt.block_size).reshape(shape)
            rows.copy_(back)      # a view of ``weight`` when transposed
    return ref


def w8a8_reference(ref, model):
    """``quantized_reference`` with each W8A8 layer's activations quantized as torch_xla's
    quantized_matmul does (row scale max|x| / 127 over the whole row, rounded in fp32), the
    products then exact in float64: the arithmetic every rank of a split layer must reproduce."""
    from AutoXLA.quantization.linear import QuantizedLinear

    ref = quantized_reference(ref, model)
    for n, m in model.named_modules():
        if isinstance(m, QuantizedLinear) and m.quantize_activation:
            linear = ref.get_submodule(n)

            def forward(x, linear=linear):
                scale = x.abs().amax(dim=-1, keepdim=True) / 127
                xq = torch.round(x / torch.where(scale == 0, 1.0, scale)).double()
                out = (xq @ linear.weight.double().T) * scale.double()
                if linear.bias is not None:
                    out = out + linear.bias.double()
                return out.to(x.dtype)
            linear.forward = forward
    return ref
