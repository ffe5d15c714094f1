"""The stored format of a quantized weight read back as numbers: int4 nibbles unpacked, the
integer values, and dequantization (``(q - zero_point) * scale`` or ``q * scale + offset``), all
with static shapes and integer ops XLA fuses into the consumer. Shared by the quantized modules
(linear.py, experts.py, embedding.py) and the matmul backends (backends.py); the layout is the
C core's (csrc/include/autoxla.h, linear.py's docstring)."""
from __future__ import annotations

import torch

from .config import LayerFormat


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 (..., rows, ceil(cols/2)) two's complement nibbles -> int32 (..., rows, cols) in
    [-8, 7] (leading dims: a mixture-of-experts layer's experts, quantization/experts.py).

    Integer ops only (and, shift, xor, subtract), which XLA fuses into the consumer; the shard
    layout survives because each byte expands in place (stack on a new last dim, then flatten).
    """
    v = packed.to(torch.int32)
    low = ((v & 15) ^ 8) - 8
    high = ((v >> 4) ^ 8) - 8
    out = torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], -1)
    return out if out.shape[-1] == cols else out[..., :cols]


def integer_weight(q: torch.Tensor, fmt: LayerFormat) -> torch.Tensor:
    """The stored weight as integer values (..., rows, in_features)."""
    return unpack_int4(q, fmt.in_features) if fmt.bits == 4 else q


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               fmt: LayerFormat, dtype: torch.dtype, offset: torch.Tensor | None = None
               ) -> torch.Tensor:
    """(q - zero_point) * scale, or q * scale + offset, in float32 per group of block_size
    inputs, cast to ``dtype``: the C core's dequantize (fp32, rounded once at the end). ``q``
    is (..., out_features, stored columns), the leading dims (experts) kept."""
    w = integer_weight(q, fmt).to(torch.float32)
    rows = tuple(q.shape[:-1])
    if fmt.ragged:   # the last block is shorter: widen each block's values over its columns
        def widen(t):
            return per_column(t.to(torch.float32), fmt)
    else:
        # The groups counted from the scale, not the format: a tensor-parallel rank of the
        # dtensor runtime holds a row linear's block of input columns and their blocks' scales,
        # and dequantizes them as a smaller layer (the same numbers as the whole layer's)
        w = w.reshape(*rows, scale.shape[-1], -1)

        def widen(t):
            return t.to(torch.float32).unsqueeze(-1)
    if zero_point is not None:
        w = w - widen(zero_point)
    w = w * widen(scale)
    if offset is not None:
        w = w + widen(offset)
    return w.reshape(*rows, -1).to(dtype)


def per_column(t: torch.Tensor, fmt: LayerFormat) -> torch.Tensor:
    """(..., rows, groups) -> (..., rows, in_features): each block's value repeated over its
    columns, the last block's over fewer (a static shape, which XLA lowers to a broadcast and a
    slice)."""
    return t.repeat_interleave(fmt.block_size, dim=-1)[..., :fmt.in_features]
