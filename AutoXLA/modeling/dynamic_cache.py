"""transformers' dynamic cache made safe on XLA for a plain forward call.

A plain ``model(ids)`` builds a ``DynamicCache`` (``use_cache`` defaults to True). Its sliding-window
layers keep the last ``window - 1`` tokens with ``full[:, :, -window + 1:, :]``: plain torch clamps
a start before the beginning, torch_xla raises ("Value out of range ... got -4095") whenever the
sequence is shorter than the window, which with Mistral's 4096 or Gemma's windows is the usual
case. The hooks installed here make every sliding layer of the call's caches one whose slices are
clamped (``ClampedSlidingWindowLayer``; nothing else of the cache changes):

- a cache the caller passes (``cache=``/``past_key_values=``) has its sliding layers converted;
- a cache the model's own code builds, wherever it builds it, gets clamped layers from the start:
  while an AutoXLA model's forward runs, transformers' table of dynamic layer classes
  (``cache_utils.DYNAMIC_LAYER_TYPE_MAPPING``, which ``DynamicCache(config=...)`` reads to make
  each layer) names the clamped class for sliding and chunked layers.

The second point is why the table and not the config: the first version of this hook built the
cache itself, from the top model's ``config.sliding_window`` and ``config.use_cache``. An
image-text-to-text model's top config (``Mistral3Config``, ``Gemma3Config``) has neither: they
live in its ``text_config``, so the hook did nothing and the language model inside built its
own cache with transformers' layers (issue 43). The table is where every ``DynamicCache`` built
from a config gets its layers, whichever model class builds it. AutoXLA's own ``generate`` uses
its static cache and is not affected.
"""
from __future__ import annotations

import threading

import torch
from torch import nn
from transformers import cache_utils
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

_CACHE_KEYS = ("cache", "past_key_values")   # transformers 5.24's name, and its deprecated one
_DEPTH = "_autoxla_dynamic_cache_depth"


def install(model: nn.Module) -> None:
    """Make ``model``'s plain forward calls use XLA-safe sliding cache layers."""
    if getattr(model, "_autoxla_dynamic_cache_hook", None) is None:
        model._autoxla_dynamic_cache_hook = (
            model.register_forward_pre_hook(_enter, with_kwargs=True),
            # always_call: the table is restored even when the forward raises.
            model.register_forward_hook(_exit, with_kwargs=True, always_call=True))


def _enter(module: nn.Module, args, kwargs):
    _clamped_layers.enter()
    module.__dict__[_DEPTH] = module.__dict__.get(_DEPTH, 0) + 1
    key = next((k for k in _CACHE_KEYS if kwargs.get(k) is not None), None)
    if key is None:
        if kwargs.get("use_cache") is None and module.training and torch.is_grad_enabled():
            # A training step needs no cache (and gradient checkpointing would replay its
            # writes): ask for none, as transformers does under gradient checkpointing.
            return args, {**kwargs, "use_cache": False}
        return None
    cache = kwargs[key]
    if isinstance(cache, DynamicCache):
        for layer in cache.layers:
            _make_safe(layer)
    return None


def _exit(module: nn.Module, args, kwargs, output):
    # Only a call whose _enter ran leaves (a pre-hook that raised never entered).
    if module.__dict__.get(_DEPTH, 0) > 0:
        module.__dict__[_DEPTH] -= 1
        _clamped_layers.exit()


class _ClampedLayerTable:
    """While at least one AutoXLA forward runs (in any thread), transformers' dynamic layer table
    gives ClampedSlidingWindowLayer where it gives DynamicSlidingWindowLayer. Counted, so that
    nested and concurrent forwards restore the table once, when the last one ends; outside them
    transformers (the tests' CPU reference included) is untouched."""

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: dict[str, type] = {}

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                table = cache_utils.DYNAMIC_LAYER_TYPE_MAPPING
                self._saved = {k: v for k, v in table.items() if v is DynamicSlidingWindowLayer}
                table.update((k, ClampedSlidingWindowLayer) for k in self._saved)
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                cache_utils.DYNAMIC_LAYER_TYPE_MAPPING.update(self._saved)
                self._saved = {}


_clamped_layers = _ClampedLayerTable()


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
