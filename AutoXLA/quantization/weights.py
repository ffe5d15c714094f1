"""One float weight through the C engine's quantizer (``_native.quantize``) in a layer's format,
its errors named after the weight: what the quantizer, the mixture-of-experts path, the
sensitivity search and the offline quantizer all quantize with."""
from __future__ import annotations

import torch

from .. import _native
from .config import LayerFormat


def quantize_tensor(w: torch.Tensor, fmt: LayerFormat, name: str = "", stats: bool = True,
                    importance: torch.Tensor | None = None) -> "_native.Quantized":
    """One float weight (out, in) -> the C engine's quantized tensors (on the CPU).
    ``importance`` (in,): per-input weights of the scale search's squared error (calibration's
    mean squared activations), used when the format searches."""
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        w = w.to(torch.float32)
    if importance is not None and fmt.search:
        importance = importance.detach().to("cpu", torch.float32).contiguous()
    else:
        importance = None
    try:
        return _native.quantize(w.contiguous(), bits=fmt.bits, symmetric=fmt.symmetric,
                                block_size=fmt.block_size, stats=stats,
                                scale_dtype=fmt.torch_scale_dtype, search=fmt.search,
                                importance=importance, offset=fmt.offset)
    except _native.NativeError as e:
        row = getattr(e, "row", None)
        if row is None:
            raise
        # The C engine's words: NaN/Inf, or finite values whose range overflows float32.
        raise ValueError(f"cannot quantize {name or 'a weight'}: {e.detail}") from e
