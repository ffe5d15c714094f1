"""The KV caches of a scanned decoder stack (modeling/scan.py runs the stack).

``StepCache`` is what one layer sees inside the loop; ``StackedStaticCache`` is generation's static
cache with one ``[layers, ...]`` K and V, a transformers ``Cache`` whose layers are views.
"""
from __future__ import annotations

import functools

import torch


class StepCache:
    """The cache one layer sees inside the loop: its own slot of the static cache (keys and
    values written at the fill level, as transformers' StaticLayer does), or, for an empty
    dynamic cache, nothing but this call's keys and values."""

    def __init__(self, keys, values, fill):
        self.keys, self.values, self.fill = keys, values, fill

    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            pos = torch.arange(key_states.shape[-2], device=key_states.device) + self.fill
            self.keys = self.keys.index_copy(2, pos, key_states)
            self.values = self.values.index_copy(2, pos, value_states)
        return self.keys, self.values


class StackedStaticCache:
    """Generation's static KV cache for a scanned stack: keys and values ``[layers, batch,
    kv_heads, length, head_dim]``, so each loop step reads and writes its layer's slot.

    ``make`` builds it as a transformers ``Cache`` whose layers are views that answer what
    transformers' mask code asks (length, fill level); the stack writes it.
    """

    @staticmethod
    def make(layers: int, length: int, keys: torch.Tensor, values: torch.Tensor):
        from transformers.cache_utils import Cache

        cls, view = _classes()
        cache = cls.__new__(cls)
        fill = torch.zeros((), dtype=torch.int64, device=keys.device)
        Cache.__init__(cache, layers=[view(cache, i, length, fill) for i in range(layers)])
        cache.keys, cache.values, cache.cumulative_length = keys, values, fill
        return cache

    def replace_layers(self, indices: range, keys, values) -> None:
        if len(indices) == self.keys.shape[0]:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys[:indices.start], keys, self.keys[indices.stop:]])
            self.values = torch.cat([self.values[:indices.start], values, self.values[indices.stop:]])

    def advance(self, tokens: int) -> None:
        self.cumulative_length.add_(tokens)

    def write_prompt(self, prompt_cache, length: int) -> None:
        """The prompt's keys and values (a filled DynamicCache) into the first ``length`` slots."""
        slots = torch.arange(length, device=self.keys.device)
        keys = torch.stack([layer.keys for layer in prompt_cache.layers])
        values = torch.stack([layer.values for layer in prompt_cache.layers])
        self.keys = self.keys.index_copy(3, slots, keys)
        self.values = self.values.index_copy(3, slots, values)
        self.advance(length)


@functools.cache
def _classes():
    """(the Cache subclass, its layer view class), built once transformers is imported."""
    from transformers.cache_utils import Cache, StaticLayer

    class LayerView(StaticLayer):
        """Layer ``i`` of a StackedStaticCache; its update (the unrolled path) writes the stack."""

        def __init__(self, parent, i, length, fill):
            super().__init__(max_cache_len=length)
            self.parent, self.index, self.cumulative_length = parent, i, fill
            self.is_initialized = True

        # Reads are the parent's slot; StaticLayer's __init__ assigns None, which is ignored.
        keys = property(lambda self: self.parent.keys[self.index], lambda self, v: None)
        values = property(lambda self: self.parent.values[self.index], lambda self, v: None)

        def update(self, key_states, value_states, *args, **kwargs):
            k, v = StepCache(self.keys, self.values, self.cumulative_length).update(
                key_states, value_states)
            p, at = self.parent, torch.tensor([self.index], device=k.device)
            p.keys = p.keys.index_copy(0, at, k.unsqueeze(0))
            p.values = p.values.index_copy(0, at, v.unsqueeze(0))
            return k, v

    cache = type("StackedStaticCache", (StackedStaticCache, Cache), {"__module__": __name__})
    return cache, LayerView
