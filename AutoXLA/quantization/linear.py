"""QuantizedLinear: an nn.Linear whose weight is stored quantized on its device.

Stored tensors (persistent buffers, so state_dict and save_pretrained carry them):
  weight             int8 (out, in), or uint8 (out, ceil(in/2)) for int4: two values per byte,
                     element 2j of a row in the low nibble, 2j+1 in the high nibble, each a 4-bit
                     two's complement value (the C core's layout, csrc/include/autoxla.h)
  weight_scale       (out, groups) of the format's scale dtype (bfloat16 unless scale_dtype says
                     otherwise): one scale per block_size inputs
  weight_zero_point  int8 (out, groups), asymmetric formats with an integer zero point
  weight_offset      (out, groups) of the scale dtype, asymmetric formats with a float offset
  bias               the float bias, a trainable Parameter, never quantized
Dequantized value: (q - zero_point) * scale, or q * scale + offset. int4 stays packed on the device and is unpacked inside
the compiled graph with integer ops, so it never costs more than half a byte per weight at rest.
"""
from __future__ import annotations

import torch
from torch import nn

from .backends import DIFFERENTIABLE, FORWARD
from .config import LayerFormat
from .packing import dequantize

class QuantizedLinear(nn.Module):
    # True where the float weight it replaces is stored (in, out) (transformers' Conv1D): the
    # loaders transpose it to rows before quantizing; what it stores is (out, in) either way
    source_transposed = False

    def __init__(self, fmt: LayerFormat, bias: bool, backend: str, quantize_activation: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        # The sharding rules recognise a quantized linear by this attribute (rules.classify).
        self.quant_format = fmt
        self.in_features, self.out_features = fmt.in_features, fmt.out_features
        self.backend = backend
        self.quantize_activation = quantize_activation
        register_quantized_buffers(self, fmt, device)
        self.bias = nn.Parameter(torch.zeros(fmt.out_features, dtype=dtype, device=device)) if bias else None

    def load_quantized(self, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                       bias: torch.Tensor | None = None, offset: torch.Tensor | None = None) -> None:
        """Install quantized tensors (e.g. from the C engine) in place of the zero buffers."""
        install_quantized(self, q, scale, zero_point, offset)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=self.bias.requires_grad if self.bias is not None else True)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.weight_zero_point, self.quant_format,
                          dtype, self.weight_offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend in DIFFERENTIABLE or not torch.is_grad_enabled():
            return FORWARD[self.backend](self, x)
        return _BackendMatmul.apply(x, self.bias, self)   # a gradient for fine-tuning (LoRA)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.quant_format.label}, backend={self.backend}"
                + (", W8A8" if self.quantize_activation else ""))


class _BackendMatmul(torch.autograd.Function):
    """A backend's forward as it runs, with the gradient of ``x @ dequantize(W).T + bias``: the
    input gradient that the layers below (their LoRA adapters) train with, and the bias's. The
    quantized weight is a buffer: it never gets one. The tensors the forward read are kept for
    the backward (the quantized ones, not a float copy): a runtime that gathers a module's
    shards only while it runs has let them go by then."""

    @staticmethod
    def forward(ctx, x, bias, layer):
        ctx.fmt, ctx.bias_dtype = layer.quant_format, None if bias is None else bias.dtype
        ctx.save_for_backward(layer.weight, layer.weight_scale, layer.weight_zero_point,
                              layer.weight_offset)
        return FORWARD[layer.backend](layer, x)

    @staticmethod
    def backward(ctx, grad):
        q, scale, zero_point, offset = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ dequantize(q, scale, zero_point, ctx.fmt, grad.dtype, offset)
        if ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_bias, None


def linear_rows(owner: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """The float weight ``owner`` is made from, as the checkpoint or the float module stores it,
    as (out, in) rows: a Conv1D's (GPT-2's, stored (in, out)) transposed; any other as it is."""
    if isinstance(owner, QuantizedLinear) and owner.source_transposed:
        return w.t().contiguous()
    return w


def register_quantized_buffers(module: nn.Module, fmt: LayerFormat, device=None,
                               leading: tuple[int, ...] = ()) -> None:
    """Zero ``weight`` (int8, or int4 packed in uint8), ``weight_scale`` and, when asymmetric,
    ``weight_zero_point`` or ``weight_offset`` buffers of ``fmt``'s shapes, after ``leading``
    dims (QuantizedExperts' experts): the names the loader, the plan and saving know a quantized
    module's tensors by (QuantizedLinear, QuantizedEmbedding, QuantizedExperts)."""
    qdtype = torch.int8 if fmt.bits == 8 else torch.uint8
    q_shape, scale_shape = leading + fmt.q_shape, leading + fmt.scale_shape
    module.register_buffer("weight", torch.zeros(q_shape, dtype=qdtype, device=device))
    # The C engine rounds each fp32 scale UP to this dtype and quantizes with the stored scale,
    # so every value stays within half a step (docs/quantization.md).
    module.register_buffer("weight_scale", torch.zeros(scale_shape,
                                                       dtype=fmt.torch_scale_dtype, device=device))
    zero_point = offset = None
    if fmt.offset:
        offset = torch.zeros(scale_shape, dtype=fmt.torch_scale_dtype, device=device)
    elif not fmt.symmetric:
        zero_point = torch.zeros(scale_shape, dtype=torch.int8, device=device)
    # A format without one still has the attribute (None): a None buffer is not saved.
    module.register_buffer("weight_zero_point", zero_point)
    module.register_buffer("weight_offset", offset)


def install_quantized(module: nn.Module, q: torch.Tensor, scale: torch.Tensor,
                      zero_point: torch.Tensor | None, offset: torch.Tensor | None = None) -> None:
    """Replaces the buffers ``register_quantized_buffers`` made by ``q``, ``scale`` and
    ``zero_point`` / ``offset``, each checked for the dtype and shape its buffer has."""
    for name, value in (("weight", q), ("weight_scale", scale), ("weight_zero_point", zero_point),
                        ("weight_offset", offset)):
        old = getattr(module, name)
        if old is None:
            continue
        if value is None or tuple(value.shape) != tuple(old.shape) or value.dtype != old.dtype:
            got = None if value is None else (value.dtype, tuple(value.shape))
            raise ValueError(f"{name} must be {old.dtype} of shape {tuple(old.shape)} for "
                             f"{module.quant_format.label} ({type(module).__name__}), got {got}")
        module._buffers[name] = value


def stored_tensors(q) -> dict[str, torch.Tensor]:
    """The C engine's result (_native.Quantized) under the buffer names a quantized module
    stores it by (register_quantized_buffers), without the parts its format has not."""
    named = {"weight": q.q, "weight_scale": q.scale, "weight_zero_point": q.zero_point,
             "weight_offset": q.offset}
    return {name: t for name, t in named.items() if t is not None}
