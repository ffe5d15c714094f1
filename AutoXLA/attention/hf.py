"""The kernels as named attention functions in transformers (AttentionInterface).

They are registered as ``autoxla_fa`` and ``autoxla_splash`` (config.TRANSFORMERS_NAMES), so a
model built by hand can use them too: ``register()``, then ``attn_implementation="autoxla_splash"``.

Every model whose attention goes through ``ALL_ATTENTION_FUNCTIONS`` (Llama, Mistral, Qwen3,
Gemma2, Ministral3/Mistral3 and most decoders of transformers 5) gets them with no per-family
patch. Each name also registers a mask function, because transformers builds the mask by the
same name: ours returns a ``KernelMask`` that says whether the mask is one the kernels can
express (causal, the sliding window, padding) for queries and keys at the same positions, and
keeps transformers' exact dense mask for every other case (decoding with a cache, packed
sequences, bidirectional overlays), which the portable path then applies as given.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from .. import backend
from ..sharding.attention_heads import KernelHeads
from . import tpu
from .blockwise import blockwise_attention, no_key_rows
from .config import KERNELS, TRANSFORMERS_NAMES, AttentionConfig

logger = logging.getLogger("AutoXLA")
_WARNED: set[str] = set()
# The mask functions transformers composes for a causal or sliding-window mask: nothing else.
_PLAIN = {"causal_mask_function", "and_masks.<locals>.and_mask",
          "sliding_window_overlay.<locals>.inner_mask"}


@dataclass
class KernelMask:
    """What transformers' mask function produced for the kernel implementations."""

    dense: Callable[[], torch.Tensor]   # -> [B, 1, Sq, Skv] bool, transformers' exact mask
    structured: bool      # causal (+window) and padding only, queries and keys at the same positions
    window: int | None    # the sliding window of this mask, read from transformers' mask function
    segment_ids: torch.Tensor | None   # [B, S] int32: 1 token, 0 padding (structured only)


@dataclass(frozen=True)
class LayerAttention:
    """Set on each patched attention module: the kernel, its config and the mesh it runs on."""

    kernel: str
    config: AttentionConfig
    mesh: object = None
    heads: KernelHeads | None = None   # the plan's head split (sharding/attention_heads.py)


# For a model that was not loaded by AutoXLA but asks for a registered name: the portable path
# with default blocks (no mesh, so never the Pallas kernels).
_UNPATCHED = {kernel: LayerAttention(kernel, AttentionConfig()) for kernel in KERNELS}


def register() -> None:
    """Registers both kernels (and their mask functions) with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for kernel in KERNELS:
        AttentionInterface.register(TRANSFORMERS_NAMES[kernel], _attention_function(kernel))
        AttentionMaskInterface.register(TRANSFORMERS_NAMES[kernel], kernel_mask)


def kernel_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask=None, **kwargs) -> KernelMask:
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = mask_function or causal_mask_function
    # A static cache passes its fill level as a tensor that its update() advances in place, and
    # the dense mask below is built later, inside attention, after that update: keep today's.
    q_offset = q_offset.clone() if isinstance(q_offset, torch.Tensor) else q_offset
    kv_offset = kv_offset.clone() if isinstance(kv_offset, torch.Tensor) else kv_offset
    names, window = _composition(mask_function)
    aligned = (isinstance(q_offset, int) and isinstance(kv_offset, int)
               and q_offset == kv_offset == 0 and q_length == kv_length)
    structured = aligned and names <= _PLAIN

    def dense():
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                         q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                         attention_mask=attention_mask, allow_is_causal_skip=False,
                         use_vmap=kwargs.get("use_vmap", False),
                         device=kwargs.get("device", "cpu"))

    segments = None
    if structured and attention_mask is not None:
        segments = attention_mask[:, :kv_length].to(torch.int32)
    return KernelMask(dense, structured, window, segments)


def _composition(fn) -> tuple[set[str], int | None]:
    """Qualified names of every function composed into ``fn``, and its sliding window if any."""
    names, window, todo = set(), None, [fn]
    while todo:
        f = todo.pop()
        names.add(getattr(f, "__qualname__", repr(f)))
        code = getattr(f, "__code__", None)
        for var, cell in zip(code.co_freevars if code else (), getattr(f, "__closure__", None) or ()):
            value = cell.cell_contents
            if var == "sliding_window" and isinstance(value, int):
                window = value
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if callable(item) and hasattr(item, "__code__"):
                    todo.append(item)
    return names, window


def _attention_function(kernel: str):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  sliding_window=None, softcap=None, **kwargs):
        return attend(kernel, module, query, key, value, attention_mask, dropout=dropout,
                      scaling=scaling, softcap=softcap, **kwargs)
    attention.__name__ = attention.__qualname__ = f"{kernel}_forward"
    return attention


def attend(kernel, module, query, key, value, attention_mask, *, dropout=0.0, scaling=None,
           softcap=None, **kwargs):
    """transformers' attention-function contract: q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D]
    -> ([B, Sq, Hq, D], None)."""
    layer = getattr(module, "autoxla_attention", _UNPATCHED[kernel])
    if layer is not None and kwargs.get("s_aux") is not None:
        # gpt-oss's attention sinks, in a model patched by hand (patch_attention leaves a model
        # with sinks on eager attention): no kernel has them; dropping them would be wrong.
        warn_once("sinks", "%s: attention sinks (gpt-oss) are in neither Pallas kernel nor "
                  "AutoXLA's portable path; the model's eager attention runs", kernel)
        layer = None
    if layer is None:          # a layer left out by attention_config['layers'], or sinks
        return _eager(module, query, key, value, attention_mask, dropout=dropout,
                      scaling=scaling, softcap=softcap, **kwargs)
    if dropout:
        raise ValueError(f"{kernel} does not implement attention dropout (p={dropout}); set the "
                         "model config's attention_dropout to 0 or use attn_implementation='eager'")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    causal = getattr(module, "is_causal", True)
    sq, skv = query.shape[2], key.shape[2]
    window, segments, dense = None, None, None
    if isinstance(attention_mask, KernelMask):
        structured = attention_mask.structured and causal
        if structured:
            window, segments = attention_mask.window, attention_mask.segment_ids
        else:
            dense = attention_mask.dense()
    elif attention_mask is None:                 # no mask at all: causal, queries at the end
        structured = causal and sq == skv
    else:                                        # a ready-made 4D mask (bool or additive)
        structured, dense = False, attention_mask
    if layer.config.attentiontype_local_sliding:   # the user's window, on top of the model's
        if dense is None:
            window = layer.config.window(window)
        else:
            dense = _narrow_to_window(dense, layer.config.window(None))

    if structured and backend.runs_pallas() and layer.mesh is not None:
        out = _on_tpu(layer, query, key, value, scale, window, softcap, segments)
        if out is not None:
            if segments is not None:
                out = _rows_without_keys_as_eager(out, query, key, value, scale, softcap,
                                                  segments, window)
            return out.transpose(1, 2).contiguous(), None
    cfg = layer.config
    block_q, block_kv = cfg.sa_block_q, cfg.sa_block_kv
    if dense is not None and sq <= block_q:
        # A dense mask skips no block, so kv tiles would only unroll the graph (XLA:CPU's compile
        # time grows much faster than the tile count). With one query block, as when decoding
        # over a static cache, the scores of all keys are one block's rows: take them at once.
        block_kv = skv
    # Padding as transformers masks it: a padded key is masked for every query, and a padded
    # query attends to the real keys before it (its own segment would be the other pads).
    q_segments = None if segments is None else torch.ones_like(segments)
    out = blockwise_attention(
        query, key, value, scale=scale, causal=causal and (structured or dense is None),
        window=window, softcap=softcap, q_segment_ids=q_segments, kv_segment_ids=segments,
        mask=dense, q_offset=skv - sq if dense is None else 0,
        block_q=block_q, block_kv=block_kv)
    return out.transpose(1, 2).contiguous(), None


def _narrow_to_window(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A causal [B, 1, Sq, Skv] mask (bool, or additive with 0 where allowed) narrowed to the
    last ``window`` keys of each query. A causal row's last allowed key is the query's own cache
    position, which is where transformers' sliding window reaches back from."""
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    cols = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(allowed, cols, -1).amax(dim=-1, keepdim=True)
    narrowed = allowed & (cols > last - window)
    if mask.dtype == torch.bool:
        return narrowed
    return mask.masked_fill(~narrowed, torch.finfo(mask.dtype).min)


def _rows_without_keys_as_eager(out, query, key, value, scale, softcap, segments, window):
    """A Pallas kernel's output [B, Hq, S, D] with the rows transformers' mask leaves without any
    key given eager attention's value there, v's mean over all S keys, and its gradient
    (blockwise.no_key_rows).

    Both kernels take padding as segment ids, a query seeing the keys of its own segment, so a
    padded query attends to the pads before it; transformers masks padded keys for every query.
    The rows where that decides a loss are those with no real key in their causal window (a
    left-padded row's pads, the last of which predicts the first real token): corrected here.
    A pad after a real token (right padding) still attends to the pads before it, not to the real
    tokens as in eager; its output only reaches its own position's logits, whose next label is a
    pad (docs/attention.md). The kernel's rows replaced here attend to pads, so they stay
    finite and add no NaN to the backward."""
    real = segments.to(torch.int32).cumsum(dim=1)                     # real keys at or before i
    if window is not None and window < real.shape[1]:
        before = torch.nn.functional.pad(real, (window, 0))[:, :real.shape[1]]
        real = real - before                                         # ... in (i - window, i]
    empty = (real == 0)[:, None, :, None]                            # [B, 1, S, 1]
    eager = no_key_rows(query, key, value, scale=scale, softcap=softcap).to(out.dtype)
    return torch.where(empty, eager, out)


def _on_tpu(layer, query, key, value, scale, window, softcap, segments):
    """The Pallas kernel for this call, or None (with one warning per reason) when it cannot
    express the call and the portable path must run instead."""
    if layer.kernel == "splash_attention":
        return tpu.run_splash(tpu.splash_arguments(
            query, key, value, scale=scale, window=window, softcap=softcap,
            segment_ids=segments, mesh=layer.mesh, cfg=layer.config, heads=layer.heads))
    if not tpu.flash_supports(window, softcap):
        warn_once("flash-window-softcap", "xla_flash_attention has no sliding window or logit "
                  "soft-cap; layers that use them run the portable path (splash_attention has both)")
        return None
    return tpu.run_flash(tpu.flash_arguments(
        query, key, value, scale=scale, causal=True, segment_ids=segments, mesh=layer.mesh,
        cfg=layer.config, heads=layer.heads))


def _eager(module, query, key, value, attention_mask, **kwargs):
    """The model's own eager attention, for layers the user kept out of the kernel."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__} has no eager_attention_forward to fall back "
                         "to; drop attention_config['layers'] to patch every layer")
    mask = attention_mask
    if isinstance(mask, KernelMask):
        allowed = mask.dense()
        mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~allowed, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, mask, **kwargs)


def warn_once(key: str, message: str, *args) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message, *args)
