"""The three matmul backends of QuantizedLinear and the one rule that picks among them.

In the seed's order of preference:
  pallas    torch_xla's Pallas TPU kernel (torch.ops.xla.quantized_matmul_int8): per-channel
            symmetric int8, and int4 unpacked to int8 inside the graph; TPU only.
  xla_op    torch.ops.xla.quantized_matmul: per-channel int8, symmetric or with a zero point
            (never with use_xla_kernel=False). Not int4 (torch_xla's int4 path copies the weight to the host on every call) and not
            blockwise (it wants an (in/bs, bs, out) layout of its own).
  fallback  dequantize + matmul in plain torch ops, which XLA fuses: every format.
A layer gets the first backend whose constraints it and the device meet (or the one the config
names, if it can run it). The choice is recorded in the plan.

``on_tpu`` says where the Pallas kernel could run: False (no TPU), True (a TPU of unknown
generation, when planning, or the emulated kernels of kernels/interpret.py), or the TPU
generation, on which a layer runs Pallas only if torch_xla tuned tiles for its shape there
(pallas_tiles.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import backend as xla
from . import pallas_tiles
from .config import LayerFormat, QuantizationConfig
from .packing import integer_weight

ORDER = ("pallas", "xla_op", "fallback")


def _pallas_unmet(fmt: LayerFormat, cfg: QuantizationConfig, on_tpu, dtype=None,
                  activations: bool = False) -> str | None:
    if cfg.use_pallas is False:
        return "use_pallas=False"
    if on_tpu is False:
        return "the Pallas kernel runs only on a TPU"
    if not fmt.symmetric:
        return "the Pallas kernel takes no zero point"
    if not fmt.per_channel:
        return "the Pallas kernel is per-channel only"
    if not activations and dtype is not None and dtype != torch.float32:
        # kernels/lowering.py: the kernel's Mosaic lowering refuses it ("Invalid dtype for
        # swap": its fp32 accumulator against bf16 activations), so a TPU compile would fail.
        return (f"torch_xla's Pallas int8 kernel does not compile for a TPU with {dtype} "
                "activations unless they are quantized too (quantize_activation=True)")
    if on_tpu is not True and not pallas_tiles.tuned_token_counts(
            on_tpu, fmt.out_features, fmt.in_features, dtype, activations):
        return (f"torch_xla tuned no tiles for a ({fmt.out_features}, {fmt.in_features}) layer "
                f"on TPU v{on_tpu} (its op would fall back to XLA's)")
    return None


def _xla_op_unmet(fmt: LayerFormat, cfg: QuantizationConfig, on_tpu, dtype=None,
                  activations: bool = False) -> str | None:
    if not cfg.use_xla_kernel:
        return "use_xla_kernel=False"
    if fmt.bits != 8:
        return "torch_xla's int4 path copies the weight to the host on every call"
    if not fmt.per_channel:
        return "torch_xla's blockwise layout is (in/block, block, out), not ours"
    if not xla.has_quantized_matmul():
        return "torch_xla is not installed"
    return None


def _fallback_unmet(fmt, cfg, on_tpu, dtype=None, activations=False) -> str | None:
    return None


_UNMET = {"pallas": _pallas_unmet, "xla_op": _xla_op_unmet, "fallback": _fallback_unmet}
# Backends that quantize activations (dynamic, per row, int8) when asked.
ACTIVATION_QUANT = frozenset({"pallas", "xla_op"})


def choose(fmt: LayerFormat, cfg: QuantizationConfig, on_tpu, layer: str = "", dtype=None,
           activations: bool = False) -> tuple[str, list[str]]:
    """(backend, why each preferred backend was passed over) for one layer whose activations
    are ``dtype`` (int8 when ``activations``)."""
    if cfg.backend != "auto":
        unmet = _UNMET[cfg.backend](fmt, cfg, on_tpu, dtype, activations)
        if unmet:
            raise ValueError(f"backend={cfg.backend!r} cannot run layer {layer!r} ({fmt.label}): "
                             f"{unmet}. Use backend='auto' to pick the best one that can")
        return cfg.backend, []
    skipped = []
    for name in ORDER:
        unmet = _UNMET[name](fmt, cfg, on_tpu, dtype, activations)
        if unmet is None:
            return name, skipped
        skipped.append(f"{name}: {unmet}")
    raise AssertionError("the fallback backend runs every format")


def _add_bias(out: torch.Tensor, layer) -> torch.Tensor:
    return out if layer.bias is None else out + layer.bias


def pallas_arguments(layer, x: torch.Tensor) -> tuple[tuple, dict]:
    """The arguments of torch_xla's Pallas int8 matmul kernel for ``layer`` on input ``x``.

    The kernel takes a 2-D x, an int8 (out, in) weight and a (out,) scale; int4 is unpacked to
    int8 values in [-8, 7] inside the graph. The tiles come from pallas_tiles (torch_xla's tuned
    table). Split out so that tests check it on its own.
    """
    w = integer_weight(layer.weight, layer.quant_format).to(torch.int8)
    x2 = x.reshape(-1, x.shape[-1])
    scale = layer.weight_scale.reshape(-1).to(torch.float32)
    tiles = pallas_tiles.tiles(xla.tpu_generation(), x2.shape[0], layer.out_features,
                               layer.in_features, x.dtype, layer.quantize_activation)
    return (x2, w, scale), {"quantize_activation": layer.quantize_activation,
                            "batch_block_size": tiles[0], "out_block_size": tiles[1],
                            "in_block_size": tiles[2]}


def _pallas_forward(layer, x: torch.Tensor) -> torch.Tensor:
    args, kwargs = pallas_arguments(layer, x)
    out = xla.pallas_quantized_matmul(*args, **kwargs)
    return _add_bias(out.reshape(*x.shape[:-1], layer.out_features).to(x.dtype), layer)


def xla_op_arguments(layer, x: torch.Tensor) -> tuple[tuple, dict]:
    """Arguments of torch.ops.xla.quantized_matmul: its zero point is pre-multiplied by the scale
    (it computes x @ (q * s)^T - x @ zp)."""
    scale = layer.weight_scale.reshape(-1).to(torch.float32)
    zp = None
    if layer.weight_zero_point is not None:
        zp = layer.weight_zero_point.reshape(-1).to(torch.float32) * scale
    elif layer.weight_offset is not None:   # y = q * s + offset: x @ y^T = x @ (q s)^T + x @ offset
        zp = -layer.weight_offset.reshape(-1).to(torch.float32)
    # Flattened to 2-D, as for the Pallas kernel: vision models feed 4-D and 5-D activations,
    # and one 2-D contraction is the case torch_xla's own tests cover.
    x2 = x.reshape(-1, x.shape[-1])
    return (x2, layer.weight, scale), {"zero_point": zp,
                                       "quantize_activation": layer.quantize_activation}


def _xla_op_forward(layer, x: torch.Tensor) -> torch.Tensor:
    args, kwargs = xla_op_arguments(layer, x)
    out = xla.quantized_matmul()(*args, **kwargs)
    return _add_bias(out.reshape(*x.shape[:-1], layer.out_features).to(x.dtype), layer)


def _fallback_forward(layer, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.dequantized_weight(x.dtype), layer.bias)


# The forward of each backend: (QuantizedLinear, x) -> y.
FORWARD = {"pallas": _pallas_forward, "xla_op": _xla_op_forward, "fallback": _fallback_forward}
