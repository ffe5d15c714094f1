"""The static KV cache of generation as plan data: shape, spec and bytes per device.

Decided from the config and the mesh alone (like the weights' plan), so `autoxla plan --batch B
--max-len L` shows it without devices and generation allocates exactly what it shows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import rules
from .configs import decoder_config
from .mesh import MeshShape, format_spec


@dataclass(frozen=True)
class KVCachePlan:
    """K and V of every decoder layer, each [batch, kv_heads, length, head_dim] (V's last dim is
    ``value_dim`` where it differs: multi-head latent attention, DeepSeek-V3's 192 and 128)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    batch: int
    length: int
    spec: tuple            # over (batch, kv heads, length, head_dim)
    reason: str = ""       # why a dimension is not split
    value_dim: int = 0     # V's head dim when it is not head_dim

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """One layer's K."""
        return (self.batch, self.kv_heads, self.length, self.head_dim)

    @property
    def value_shape(self) -> tuple[int, int, int, int]:
        """One layer's V."""
        return (self.batch, self.kv_heads, self.length, self.value_dim or self.head_dim)

    def _element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def total_bytes(self) -> int:
        """K and V of all layers, whole."""
        return self.layers * (math.prod(self.shape) + math.prod(self.value_shape)) * \
            self._element_size()

    def shard_shape(self, mesh: MeshShape, shape=None) -> tuple[int, int, int, int]:
        """One layer's K (or ``shape``, e.g. value_shape) on one device."""
        return tuple(s // mesh.size(a) for s, a in zip(shape or self.shape, self.spec))

    def bytes_per_device(self, mesh: MeshShape) -> int:
        return self.layers * (math.prod(self.shard_shape(mesh)) + math.prod(
            self.shard_shape(mesh, self.value_shape))) * self._element_size()

    def describe(self, mesh: MeshShape) -> str:
        dims = "x".join(map(str, self.shape))
        if self.value_shape != self.shape:
            dims += "] and [" + "x".join(map(str, self.value_shape))
        line = (f"KV cache at batch {self.batch}, length {self.length}: {self.layers} layers x K,V "
                f"[{dims}] {self.dtype}, spec {format_spec(self.spec)}, "
                f"{self.bytes_per_device(mesh) / 2**20:.2f} MiB per device "
                f"({self.total_bytes / 2**20:.2f} MiB in all)")
        return line + (f"; {self.reason}" if self.reason else "")


def attention_shape(config) -> tuple[int, ...]:
    """(decoder layers, kv heads, head dim) of a causal LM's config (its text config if nested),
    and V's head dim after them where it differs. Multi-head latent attention (DeepSeek) caches its
    compressed latent, as transformers 5.24 does: one "head" whose K is the kv_lora_rank latent
    and whose V is the shared qk_rope_head_dim rotary key."""
    text = decoder_config(config)
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    layers = getattr(text, "num_hidden_layers", None)
    if not (heads and kv and head_dim and layers):
        raise ValueError(f"{type(config).__name__} does not say its attention shape "
                         "(num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim): "
                         "AutoXLA cannot plan a KV cache for it")
    latent, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
    if latent and rope and layers:
        return (layers, 1, latent) + ((rope,) if rope != latent else ())
    return layers, kv, head_dim


def kv_cache_for(attention: tuple[int, int, int], mesh: MeshShape, dtype: torch.dtype | str,
                 batch: int, length: int) -> KVCachePlan:
    """Batch over (data, fsdp) and kv heads over model where they divide; the rest replicated,
    with the reason. Sequence and head_dim are never split (every decode step writes one slot).
    ``attention`` is ``attention_shape(config)``."""
    layers, kv_heads, head_dim, *value_dim = attention
    reasons = []
    batch_spec = rules.batch_axes(mesh, batch)
    if batch_spec is None and mesh.size(("data", "fsdp")) > 1:
        reasons.append(f"batch {batch} does not divide data*fsdp = {mesh.size(('data', 'fsdp'))}")
    head_spec = None
    if mesh.model > 1:
        if kv_heads % mesh.model == 0:
            head_spec = "model"
        else:
            reasons.append(f"{kv_heads} kv heads do not divide model axis {mesh.model}")
    dtype = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return KVCachePlan(layers, kv_heads, head_dim, dtype, batch, length,
                       (batch_spec, head_spec, None, None), "; ".join(reasons),
                       value_dim=value_dim[0] if value_dim else 0)
