"""Image-text-to-text models (Mistral 3, LLaVA, ...) on XLA: merging image features into the text.

transformers merges a vision tower's features into the token embeddings with
``inputs_embeds.masked_scatter(image_token_mask, features)``. torch_xla lowers ``masked_scatter``
through a data-dependent ``nonzero``; with the embeddings sharded (SPMD) XLA's dynamic padder then
refuses the program ("Dynamic input unexpectedly found for unsupported instruction", torch_xla
2.9). While such a model runs with ``pixel_values``, ``masked_scatter`` on XLA tensors is computed
with static shapes instead: the k-th masked position takes the source's k-th element, found by a
running count of the mask (cumsum) and a gather. Same values, same order, as torch's.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_MODE = "_autoxla_static_scatter"


def static_masked_scatter(target: torch.Tensor, mask: torch.Tensor, source: torch.Tensor):
    """``target.masked_scatter(mask, source)`` without data-dependent shapes."""
    mask = torch.broadcast_to(mask, target.shape).reshape(-1)
    flat = target.reshape(-1)
    index = (mask.to(torch.int64).cumsum(0) - 1).clamp(min=0)   # k-th True -> source element k
    picked = source.reshape(-1).to(target.dtype).index_select(0, index)
    return torch.where(mask, picked, flat).view_as(target)


class _StaticMaskedScatter(TorchFunctionMode):
    _FUNCS = (torch.Tensor.masked_scatter, torch.masked_scatter)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FUNCS and args and args[0].device.type == "xla":
            target, mask, source = (list(args) + [kwargs.get("mask"), kwargs.get("source")])[:3]
            # transformers has checked that the mask counts as many positions as source holds
            # (get_placeholder_mask); an empty source is left to torch's own checks.
            if source.numel():
                return static_masked_scatter(target, mask, source)
        return func(*args, **kwargs)


def _enter(module, args, kwargs):
    pixels = kwargs.get("pixel_values")
    if pixels is None and args:                     # passed positionally
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        pixels = bound.arguments.get("pixel_values")
    if pixels is not None:                          # text-only calls never merge images
        mode = _StaticMaskedScatter()
        mode.__enter__()
        module.__dict__.setdefault(_MODE, []).append(mode)


def _exit(module, args, kwargs, output):
    stack = module.__dict__.get(_MODE)
    if stack:
        stack.pop().__exit__(None, None, None)


def merge_images_statically(model: nn.Module) -> None:
    """Hooks ``model``'s forward so that calls with ``pixel_values`` merge image features with
    static shapes (``always_call``: the mode is left even when the forward raises)."""
    model.register_forward_pre_hook(_enter, with_kwargs=True)
    model.register_forward_hook(_exit, with_kwargs=True, always_call=True)
