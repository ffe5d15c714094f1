"""The three matmul backends of QuantizedLinear and the one rule that picks among them.

In the seed's order of preference:
  pallas    torch_xla's Pallas TPU kernel (torch.ops.xla.quantized_matmul_int8): per-channel
            symmetric int8, and int4 unpacked to int8 inside the graph; TPU only.
  xla_op    torch.ops.xla.quantized_matmul: per-channel int8, symmetric or with a zero point
            (never with use_xla_kernel=False). Not int4 (torch_xla's int4 path copies the weight to the host on every call) and not
            blockwise (it wants an (in/bs, bs, out) layout of its own).
  torch_int8  PyTorch's own int8 matmul (torch._int_mm) on dynamically quantized int8
            activations: W8A8 where torch_xla is not installed (the dtensor runtime), for
            per-channel formats (int4 unpacked to int8 values); with torch_xla's arithmetic.
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

ORDER = ("pallas", "xla_op", "torch_int8", "fallback")


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


def _torch_int8_unmet(fmt: LayerFormat, cfg: QuantizationConfig, on_tpu, dtype=None,
                      activations: bool = False) -> str | None:
    if not activations:
        return "weight-only: it is for int8 activations (quantize_activation=True)"
    if not fmt.per_channel:
        return "per-channel formats only (one weight scale per output row, as torch_xla's op)"
    if xla.has_quantized_matmul():
        return "torch_xla is installed: its own op (xla_op) runs W8A8 there"
    return None


def _fallback_unmet(fmt, cfg, on_tpu, dtype=None, activations=False) -> str | None:
    return None


_UNMET = {"pallas": _pallas_unmet, "xla_op": _xla_op_unmet, "torch_int8": _torch_int8_unmet,
          "fallback": _fallback_unmet}
# Backends that quantize activations (dynamic, per row, int8) when asked.
ACTIVATION_QUANT = frozenset({"pallas", "xla_op", "torch_int8"})
# Backends only for layers whose activations are quantized.
ACTIVATIONS_ONLY = frozenset({"torch_int8"})


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
        if name in ACTIVATIONS_ONLY and not activations:
            continue    # not a candidate for weight-only layers (and not worth a note)
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


# A runtime that splits a layer's input features over ranks (the dtensor runtime's row linears)
# sets this attribute on the module while it runs: it takes each rank's per-row maximum |x| and
# returns the whole row's, so every rank quantizes with the scale the unsplit layer would use.
ROW_ABSMAX = "_autoxla_row_absmax"


def _torch_int8_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """W8A8 with torch_xla's arithmetic (its quantized_matmul with quantize_activation=True):
    each activation row scaled by max|x| / 127 and rounded to int8, in the activations' dtype
    as torch_xla does (so a bf16 model quantizes alike on both runtimes), an int32 matmul, then
    the weight's per-channel scale (and zero point or offset) and the row's scale in fp32."""
    fmt = layer.quant_format
    w = integer_weight(layer.weight, fmt).to(torch.int8)
    x2 = x.reshape(-1, x.shape[-1])
    absmax = x2.abs().amax(dim=-1, keepdim=True)
    combine = layer.__dict__.get(ROW_ABSMAX)
    if combine is not None:
        absmax = combine(absmax)
    x_scale = absmax / 127
    # An all-zero row has scale 0: its integers are 0 and so is its output (before the bias)
    # (in bf16 the row's maximum can round to 128: saturated, not wrapped to -128)
    xq = torch.round(x2 / torch.where(x_scale == 0, 1.0, x_scale)).clamp(-128, 127).to(torch.int8)
    out = torch._int_mm(xq, w.t()).to(torch.float32)
    scale = layer.weight_scale.reshape(-1).to(torch.float32)
    out = out * scale
    if layer.weight_zero_point is not None:     # (q - zp) s: x (q s)^T - sum(x) zp s
        zp = layer.weight_zero_point.reshape(-1).to(torch.float32) * scale
        out = out - xq.sum(dim=-1, keepdim=True, dtype=torch.int32).to(torch.float32) * zp
    elif layer.weight_offset is not None:       # q s + offset: x (q s)^T + sum(x) offset
        offset = layer.weight_offset.reshape(-1).to(torch.float32)
        out = out + xq.sum(dim=-1, keepdim=True, dtype=torch.int32).to(torch.float32) * offset
    out = out * x_scale
    return _add_bias(out.reshape(*x.shape[:-1], -1).to(x.dtype), layer)


def _fallback_forward(layer, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.dequantized_weight(x.dtype), layer.bias)


# The backends whose forward autograd differentiates as it is (plain torch ops). The others
# are custom kernels without a backward (torch_xla's quantized matmuls) or round the activations
# (W8A8: a zero gradient): QuantizedLinear gives them the dequantized matmul's input gradient
# (linear.py), the straight-through gradient for W8A8.
DIFFERENTIABLE = frozenset({"fallback"})

# The forward of each backend: (QuantizedLinear, x) -> y.
FORWARD = {"pallas": _pallas_forward, "xla_op": _xla_op_forward,
           "torch_int8": _torch_int8_forward, "fallback": _fallback_forward}
