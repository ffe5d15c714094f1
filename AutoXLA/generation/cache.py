"""The static KV cache: allocated once per generate call at its bucketed length, on the devices,
sharded as its plan says (sharding/kv_cache.py).

It is a transformers ``Cache`` of ``StaticLayer``s, so every model's attention writes it with
transformers' own code (``index_copy_`` at a position held in a device tensor: the same program
every step). Sliding-window layers get a full-length ``StaticLayer`` too: transformers'
``StaticSlidingWindowLayer`` keeps its fill level as a Python int and branches on it, which makes
a new program every step (transformers #44609). The window is still applied, by the mask
transformers builds from the config; the cost is memory: such a layer holds the whole length
instead of its window (the plan's KV line counts it so).
"""
from __future__ import annotations

import torch

from .. import backend
from ..sharding.kv_cache import KVCachePlan


def allocate(kv: KVCachePlan, mesh, device):
    """An empty ``transformers.Cache`` of ``kv.layers`` static layers, each K and V sharded."""
    from transformers.cache_utils import Cache, StaticLayer

    layers = []
    dtype = getattr(torch, kv.dtype)
    for _ in range(kv.layers):
        layer = StaticLayer(max_cache_len=kv.length)
        probe = torch.empty((kv.batch, kv.kv_heads, 1, kv.head_dim), dtype=dtype, device=device)
        layer.lazy_initialization(probe, probe)    # transformers' own set-up, then our sharding
        layers.append(layer)
    cache = Cache(layers=layers)
    pin(cache, kv, mesh)
    return cache


def pin(cache, kv: KVCachePlan, mesh) -> None:
    """Re-annotate every layer's K and V with the planned spec (after each step writes them).

    Otherwise their sharding is whatever XLA's propagation gave the step's outputs, which may
    differ between the prefill and a decode step: a different input sharding is a different
    program, and the first decode step would compile one of its own.
    """
    for layer in cache.layers:
        backend.mark_sharding(layer.keys, mesh, kv.spec)
        backend.mark_sharding(layer.values, mesh, kv.spec)
