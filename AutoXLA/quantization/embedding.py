"""QuantizedEmbedding: an nn.Embedding whose table is stored as int8 on its device.

Stored tensors (persistent buffers, named as QuantizedLinear's so that the loader, the plan and
save_pretrained treat both alike):
  weight             int8 (num_embeddings, embedding_dim): the table, per row
  weight_scale       (num_embeddings, 1) of the config's scale dtype: one scale per row
  weight_zero_point  int8 (num_embeddings, 1), asymmetric formats only
A lookup gathers the rows of the int8 table and their scales and dequantizes only those rows, with
the arithmetic of packing.dequantize (fp32, one rounding to the output dtype), so the full-precision
table never exists on the device.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import LayerFormat
from .linear import install_quantized, register_quantized_buffers

# The plan records this as the quantized table's "backend" (its lookup is a gather).
GATHER = "gather"


class QuantizedEmbedding(nn.Embedding):
    """An int8 embedding table; ``isinstance(m, nn.Embedding)`` stays true, so the sharding
    rules (and transformers' get_input_embeddings) see an embedding."""

    def __init__(self, fmt: LayerFormat, padding_idx: int | None = None,
                 dtype: torch.dtype = torch.float32, device=None):
        nn.Module.__init__(self)   # not nn.Embedding's: it would allocate a float table
        if fmt.bits != 8 or not fmt.per_channel or fmt.offset:
            raise ValueError(f"QuantizedEmbedding stores int8 with one scale per row, got {fmt.label}")
        # The sharding rules recognise a quantized module by this attribute (rules.classify).
        self.quant_format = fmt
        self.backend = GATHER
        self.num_embeddings, self.embedding_dim = fmt.out_features, fmt.in_features
        self.padding_idx = padding_idx
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False
        self.output_dtype = dtype   # the float table's dtype: what a lookup returns
        register_quantized_buffers(self, fmt, device)

    def load_quantized(self, q: torch.Tensor, scale: torch.Tensor,
                       zero_point: torch.Tensor | None) -> None:
        """Install the C engine's tensors in place of the zero buffers."""
        install_quantized(self, q, scale, zero_point)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        rows = self.weight.index_select(0, flat).to(torch.float32)
        if self.weight_zero_point is not None:
            rows = rows - self.weight_zero_point.index_select(0, flat).to(torch.float32)
        rows = rows * self.weight_scale.index_select(0, flat).to(torch.float32)
        return rows.to(self.output_dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, format={self.quant_format.label}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""))
