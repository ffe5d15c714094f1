"""QuantizedExperts: one projection of a mixture-of-experts layer, all its experts, stored quantized.

transformers 5 keeps a layer's experts as one ``[experts, ...]`` parameter per projection
(``gate_up_proj``, ``down_proj``) on its experts module. ModelQuantizer replaces such a parameter
by this module under the same attribute, so the quantized tensors carry the names every quantized
layer has (``experts.gate_up_proj.weight``, ``.weight_scale``, ...), which the plan, the loader
and saving already know:

  weight             int8 [experts, out, in], or uint8 [experts, out, ceil(in/2)] for int4
  weight_scale       [experts, out, groups]; weight_zero_point / weight_offset as QuantizedLinear's

Each expert's (out, in) matrix is quantized exactly as a QuantizedLinear of that shape (scales
per output row, blocks along the input): the C engine quantizes the ``experts x out`` rows in one
call. A transposed checkpoint layout (gpt-oss keeps [experts, in, out]) is stored [experts, out,
in] too, so that scales run along output channels as everywhere else. The forward
(moe.py) dequantizes inside the compiled graph and multiplies as with a float
weight: no torch_xla quantized kernel takes a batch of expert matrices.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import LayerFormat
from .linear import install_quantized, register_quantized_buffers
from .packing import dequantize
from .weights import quantize_tensor

# The plan's "backend" of quantized experts: dequantize in the graph, then the experts' einsum.
EXPERTS_BACKEND = "fallback"
WHY_NO_KERNEL = ("experts: torch_xla's quantized matmul kernels take one 2-D weight, not "
                 "[experts, out, in]; dequantized in the graph")


class QuantizedExperts(nn.Module):
    """``num_experts`` quantized (out, in) matrices of one format, never called: the experts
    module's forward reads ``dequantized_weight``."""

    def __init__(self, fmt: LayerFormat, num_experts: int, source_transposed: bool, device=None):
        super().__init__()
        # The sharding rules recognise a quantized module by this attribute (rules.classify).
        self.quant_format = fmt
        self.backend = EXPERTS_BACKEND
        # Never called, so a runtime that gathers a module's shards as it runs (the dtensor
        # runtime's executor) gathers these with the experts module that reads them
        self.gathered_with_parent = True
        self.num_experts = num_experts
        self.source_transposed = source_transposed   # the float parameter was [E, in, out]
        register_quantized_buffers(self, fmt, device, leading=(num_experts,))

    @property
    def source_shape(self) -> tuple[int, int, int]:
        """The float parameter's shape, as a float checkpoint holds it."""
        fmt = self.quant_format
        inner = (fmt.in_features, fmt.out_features) if self.source_transposed else (
            fmt.out_features, fmt.in_features)
        return (self.num_experts,) + inner

    def load_quantized(self, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                       offset: torch.Tensor | None = None) -> None:
        install_quantized(self, q, scale, zero_point, offset)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[experts, out, in] in ``dtype`` (whatever the source layout was)."""
        return dequantize(self.weight, self.weight_scale, self.weight_zero_point, self.quant_format,
                          dtype, self.weight_offset)

    def forward(self, *args, **kwargs):
        raise TypeError("QuantizedExperts holds an experts module's weights and is not called; "
                        "the experts module's forward dequantizes them")

    def extra_repr(self) -> str:
        fmt = self.quant_format
        return (f"experts={self.num_experts}, in_features={fmt.in_features}, "
                f"out_features={fmt.out_features}, format={fmt.label}")


def experts_format(config, name: str, weight: torch.Tensor, transposed: bool) -> LayerFormat:
    """The format of the experts parameter ``name`` ([E, out, in], or [E, in, out] transposed)."""
    rows, cols = weight.shape[1:]
    out_features, in_features = (cols, rows) if transposed else (rows, cols)
    return config.layer_format(name, in_features, out_features)


def as_rows(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A float experts parameter as the [E x out, in] rows the C engine quantizes."""
    if transposed:
        weight = weight.transpose(1, 2)
    return weight.reshape(-1, weight.shape[-1]).contiguous()


def quantize_experts(weight: torch.Tensor, module: QuantizedExperts, name: str = ""):
    """A float experts parameter -> the C engine's result with its tensors [E, out, ...] (the
    per-row statistics stay flat)."""
    q = quantize_tensor(as_rows(weight, module.source_transposed), module.quant_format, name)
    experts = module.num_experts
    return q._replace(**{k: getattr(q, k).reshape(experts, -1, getattr(q, k).shape[-1])
                         for k in ("q", "scale", "zero_point", "offset") if getattr(q, k) is not None})

