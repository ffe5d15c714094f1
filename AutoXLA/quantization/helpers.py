"""The original AutoXLA's quantization helpers, as thin functions over ModelQuantizer.

``quantize_llm`` and its three presets build a QuantizationConfig and call
ModelQuantizer.quantize_model: there is no second quantizer. ``pack_int4_to_int8`` /
``unpack_int8_to_int4`` reproduce the original's byte layout, which is not the layout
QuantizedLinear stores (docs/quantization.md, "int4 packing helpers"):

  original helpers   the tensor flattened, consecutive pairs (element 2j low nibble, 2j+1 high),
                     each nibble offset binary (value + 8), an odd count padded with value 0
                     (nibble 8), returned as int8 of ceil(n/2) elements
  C engine / stored  per row, the same pair order, each nibble two's complement (value & 15), an
                     odd row's last high nibble 0, uint8 (rows, ceil(cols/2))
So for rows of even length, original byte = stored byte XOR 0x88 (tests pin both).
"""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..state import state_of
from .config import QuantizationConfig
from .quantizer import ModelQuantizer, get_model_size

logger = logging.getLogger("AutoXLA")

__all__ = ["get_model_size", "pack_int4_to_int8", "quantize_llm", "quantize_llm_blockwise",
           "quantize_llm_int4", "quantize_llm_int8", "unpack_int8_to_int4"]


def quantize_llm(model: nn.Module, n_bits: int = 8, block_size: int = -1, symmetric: bool = True,
                 quantize_activation: bool = False, use_pallas: bool = False,
                 auto_tune_block_sizes: bool = True, pack_4bit: bool = True) -> nn.Module:
    """Quantize ``model``'s linears in place (the original's signature); returns ``model``.

    Equivalent to ``ModelQuantizer(QuantizationConfig(...)).quantize_model(model)``; the report
    is ``model.autoxla_quantization``. use_pallas=False (the original's default) never uses the
    Pallas kernel; pass None for "on a TPU, when it can".
    """
    config = QuantizationConfig(n_bits=n_bits, block_size=block_size, symmetric=symmetric,
                                quantize_activation=quantize_activation, use_pallas=use_pallas,
                                auto_tune_block_sizes=auto_tune_block_sizes, pack_4bit=pack_4bit)
    model = ModelQuantizer(config).quantize_model(model)
    report = state_of(model).quantization
    logger.info("quantize_llm: model weights %.2f MiB -> %.2f MiB (%.2fx smaller)",
                report.bytes_before / 2**20, report.bytes_after / 2**20,
                report.bytes_before / max(report.bytes_after, 1))
    return model


def quantize_llm_int4(model: nn.Module, use_pallas: bool = False, pack_4bit: bool = True,
                      quantize_activation: bool = True) -> nn.Module:
    """int4 per-channel. As in the original, activations are asked to be int8 (only the Pallas
    kernel can do that for int4; elsewhere the quantizer warns that they stay float)."""
    return quantize_llm(model, n_bits=4, use_pallas=use_pallas, pack_4bit=pack_4bit,
                        quantize_activation=quantize_activation)


def quantize_llm_int8(model: nn.Module, use_pallas: bool = False,
                      quantize_activation: bool = True) -> nn.Module:
    """int8 per-channel with int8 activations (W8A8), as in the original."""
    return quantize_llm(model, n_bits=8, use_pallas=use_pallas,
                        quantize_activation=quantize_activation)


def quantize_llm_blockwise(model: nn.Module, block_size: int = 128, n_bits: int = 4,
                           use_pallas: bool = False, pack_4bit: bool = True) -> nn.Module:
    """Blockwise (default int4, 128 inputs per scale); block_size must divide every quantized
    layer's input size (the error names the layer)."""
    return quantize_llm(model, n_bits=n_bits, block_size=block_size, use_pallas=use_pallas,
                        pack_4bit=pack_4bit)


_INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _check_int4_values(values: torch.Tensor) -> None:
    if not isinstance(values, torch.Tensor) or values.dtype not in _INTEGER_DTYPES:
        got = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"pack_int4_to_int8 takes an integer tensor of values in [-8, 7], got "
                         f"{got}; round and cast first, e.g. q.round().to(torch.int8)")
    if values.numel():
        lo, hi = int(values.min()), int(values.max())
        if lo < -8 or hi > 7:
            raise ValueError(f"pack_int4_to_int8 packs signed 4-bit values in [-8, 7], got "
                             f"values in [{lo}, {hi}]; shift unsigned [0, 15] values by -8 first")


def pack_int4_to_int8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """Signed 4-bit values -> (int8 of ceil(n/2) bytes, the input's shape), the original's layout:
    flattened, element 2j in the low nibble and 2j+1 in the high one, each stored as value + 8."""
    _check_int4_values(values)
    shape = values.shape
    flat = values.reshape(-1).to(torch.int16)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])   # padded with the value 0, as the original
    nibbles = (flat + 8).to(torch.uint8).reshape(-1, 2)
    packed = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return packed.view(torch.int8), shape


def unpack_int8_to_int4(packed: torch.Tensor, original_shape) -> torch.Tensor:
    """The inverse of pack_int4_to_int8: int8 values in [-8, 7] of ``original_shape``."""
    shape = torch.Size(original_shape)
    n = math.prod(shape)
    if not isinstance(packed, torch.Tensor) or packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError("unpack_int8_to_int4 takes the int8 (or uint8) tensor pack_int4_to_int8 "
                         f"returned, got {getattr(packed, 'dtype', type(packed).__name__)}")
    if packed.numel() != (n + 1) // 2:
        raise ValueError(f"{packed.numel()} packed bytes cannot hold {n} values of shape "
                         f"{tuple(shape)} (needs {(n + 1) // 2}); pass the shape pack_int4_to_int8 "
                         "returned with its tensor")
    p = packed.reshape(-1)
    p = p.view(torch.uint8) if p.dtype == torch.int8 else p
    both = torch.stack([p & 15, p >> 4], dim=1).reshape(-1)[:n]
    return (both.to(torch.int8) - 8).reshape(shape)
