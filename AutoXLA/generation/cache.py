"""The KV cache of one generate call.

On a runtime whose steps are compiled for fixed shapes (``engine.static_shapes``: the xla
runtime), a static cache: allocated once per call at its bucketed length, on the devices, sharded
as its plan says (sharding/kv_cache.py). On one whose steps run as they are (the dtensor runtime),
transformers' ``DynamicCache``, which grows by a slot per step, as in transformers' own loop: with
no program to reuse, fixed shapes would buy nothing and cost attention over the empty slots (a
static cache needs a mask where a grown one lets SDPA run without one); each rank's layers hold
the rows and heads it computed.

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

from ..sharding.kv_cache import KVCachePlan
from .stacked_cache import StackedStaticCache


def allocate(kv: KVCachePlan, mesh, device, engine, stacked: bool = False):
    """An empty ``transformers.Cache`` of ``kv.layers`` static layers, each K and V sharded; for a
    scanned decoder stack (``stacked``), one ``[layers, ...]`` K and V that the loop indexes; an
    empty ``DynamicCache`` where the engine has no fixed shapes."""
    from transformers.cache_utils import Cache, DynamicCache, StaticLayer

    if not engine.static_shapes:
        return DynamicCache()        # no config: full layers, the sliding ones too (masks window)
    dtype = getattr(torch, kv.dtype)
    if stacked:
        cache = StackedStaticCache.make(
            kv.layers, kv.length, torch.zeros((kv.layers, *kv.shape), dtype=dtype, device=device),
            torch.zeros((kv.layers, *kv.value_shape), dtype=dtype, device=device))
        pin(cache, kv, mesh, engine)
        return cache
    layers = []
    for _ in range(kv.layers):
        layer = StaticLayer(max_cache_len=kv.length)
        keys = torch.empty((kv.batch, kv.kv_heads, 1, kv.head_dim), dtype=dtype, device=device)
        values = torch.empty(kv.value_shape[:2] + (1, kv.value_shape[3]), dtype=dtype, device=device)
        layer.lazy_initialization(keys, values)    # transformers' own set-up, then our sharding
        layers.append(layer)
    cache = Cache(layers=layers)
    pin(cache, kv, mesh, engine)
    return cache


def pin(cache, kv: KVCachePlan, mesh, engine) -> None:
    """Re-annotate every layer's K and V with the planned spec (after each step writes them).

    Otherwise their sharding is whatever XLA's propagation gave the step's outputs, which may
    differ between the prefill and a decode step: a different input sharding is a different
    program, and the first decode step would compile one of its own.
    """
    if isinstance(cache, StackedStaticCache):          # the layer axis unsplit
        engine.mark_sharding(cache.keys, mesh, (None, *kv.spec))
        engine.mark_sharding(cache.values, mesh, (None, *kv.spec))
        engine.mark_sharding(cache.cumulative_length, mesh, ())
        return
    for layer in cache.layers:
        if layer.is_initialized:
            engine.mark_sharding(layer.keys, mesh, kv.spec)
            engine.mark_sharding(layer.values, mesh, kv.spec)


def grows(cache) -> bool:
    """A cache that grows per step (transformers' DynamicCache), not a static one."""
    from transformers.cache_utils import DynamicCache

    return isinstance(cache, DynamicCache)


def write_prompt(cache, prompt_cache, length: int, device) -> None:
    """The prompt's keys and values (a DynamicCache the prefill filled) into the first slots."""
    if isinstance(cache, StackedStaticCache):
        cache.write_prompt(prompt_cache, length)
        return
    slots = torch.arange(length, device=device)
    for static, filled in zip(cache.layers, prompt_cache.layers):
        static.keys.index_copy_(2, slots, filled.keys)
        static.values.index_copy_(2, slots, filled.values)
        static.cumulative_length.add_(length)
