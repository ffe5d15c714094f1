"""transformers' dynamic cache made safe on XLA for a plain forward call.

A plain ``model(ids)`` builds a ``DynamicCache`` (``use_cache`` defaults to True). Its sliding-window
layers keep the last ``window - 1`` tokens with ``full[:, :, -window + 1:, :]``: plain torch clamps
a start before the beginning, torch_xla raises ("Value out of range ... got -4095") whenever the
sequence is shorter than the window, which with Mistral's 4096 or Gemma's windows is the usual
case. The forward pre-hook installed here gives every sliding layer of the call's cache (the one
transformers would build, or one the caller passes) a subclass whose slices are clamped; nothing
else of the cache changes. AutoXLA's own ``generate`` uses its static cache and is not affected.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

_CACHE_KEYS = ("cache", "past_key_values")   # transformers 5.24's name, and its deprecated one


def install(model: nn.Module) -> None:
    """Make ``model``'s plain forward calls use XLA-safe sliding cache layers."""
    if getattr(model, "_autoxla_dynamic_cache_hook", None) is None:
        model._autoxla_dynamic_cache_hook = model.register_forward_pre_hook(
            _safe_cache, with_kwargs=True)


def _safe_cache(module: nn.Module, args, kwargs):
    key = next((k for k in _CACHE_KEYS if kwargs.get(k) is not None), None)
    if key is None:
        use_cache = kwargs.get("use_cache")
        config = getattr(module, "config", None)
        if use_cache is None and module.training and torch.is_grad_enabled():
            # A training step needs no cache (and gradient checkpointing would replay its
            # writes): ask for none, as transformers does under gradient checkpointing.
            return args, {**kwargs, "use_cache": False}
        if use_cache is None:
            use_cache = getattr(config, "use_cache", False)
        if not use_cache or config is None or getattr(config, "sliding_window", None) is None:
            return None
        cache = DynamicCache(config=config.get_text_config(decoder=True))
        kwargs = {**kwargs, "cache": cache}
    else:
        cache = kwargs[key]
    if isinstance(cache, DynamicCache):
        for layer in cache.layers:
            _make_safe(layer)
    return args, kwargs


def _make_safe(layer) -> None:
    if type(layer) is DynamicSlidingWindowLayer:
        layer.__class__ = ClampedSlidingWindowLayer


def _last(t: torch.Tensor, n: int) -> torch.Tensor:
    """The last ``n`` positions of ``t`` along dim -2 (all of them when it has fewer)."""
    return t[:, :, max(t.shape[-2] - n, 0):, :]


class ClampedSlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers 5.24's DynamicSlidingWindowLayer.update with the window slices clamped."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        full_keys = torch.cat([self.keys, key_states], dim=-2)
        full_values = torch.cat([self.values, value_states], dim=-2)
        if not self.record_past:
            self.keys = _last(full_keys, self.sliding_window - 1)
            self.values = _last(full_values, self.sliding_window - 1)
            return full_keys, full_values
        self.keys, self.values = full_keys, full_values
        visible = self.sliding_window - 1 + key_states.shape[-2]
        return _last(full_keys, visible), _last(full_values, visible)
