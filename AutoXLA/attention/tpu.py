"""The only module that calls torch_xla's Pallas attention kernels (TPU only, never run here).

Each kernel has an ``*_arguments`` function that builds exactly what the call receives, so the
translation from transformers' conventions is unit-tested without a TPU, and a ``run_*``
function that makes the call. Facts the translation relies on (TORCH_XLA_NOTES.md section 5):

- ``flash_attention(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale, partition_spec=,
  mesh=)``: [B, H, S, D], no GQA (kv heads are repeated here), no soft-cap, no window.
- ``splash_attention(q, k, v, config_json, decoder_segment_ids, causal, attn_logits_soft_cap)``:
  GQA native, no ``sm_scale`` (q is pre-scaled), Sq == Skv, the mesh string inside the JSON, and a
  local window ``LocalMask(window_size=(w, w))`` that admits ``q - w <= k``: transformers' window
  ``W`` admits ``q - k < W``, so ``w = W - 1``.
"""
from __future__ import annotations

import dataclasses

import torch

from .config import AttentionConfig


def default_qkv_spec(num_heads: int, mesh) -> tuple:
    """Batch over (data, fsdp); heads over model when they divide it, else replicated."""
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    model = sizes.get("model", 1)
    heads = "model" if model > 1 and num_heads % model == 0 else None
    return (("data", "fsdp"), heads, None, None)


def flash_supports(window: int | None, softcap: float | None) -> bool:
    """Pallas flash attention has neither a sliding window nor a logit soft-cap."""
    return window is None and softcap is None


def flash_arguments(q, k, v, *, scale: float, causal: bool, segment_ids, mesh,
                    cfg: AttentionConfig) -> dict:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:   # transformers' repeat_kv order: kv head h serves query heads h*G .. h*G+G-1
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    spec = cfg.qkv_partition_spec or default_qkv_spec(q.shape[1], mesh)
    return dict(q=q, k=k, v=v, causal=causal, q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids, sm_scale=scale, partition_spec=spec, mesh=mesh)


def run_flash(arguments: dict) -> torch.Tensor:
    from torch_xla.experimental.custom_kernel import flash_attention

    a = dict(arguments)
    return flash_attention(a.pop("q"), a.pop("k"), a.pop("v"), **a)


def splash_misfit(seq_len: int, cfg: AttentionConfig) -> str | None:
    """Why splash cannot take this sequence length, or None. Each of its block sizes is
    min(configured, seq_len) and must divide seq_len (splash does not pad, flash does)."""
    for key in ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv",
                "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq"):
        block = min(getattr(cfg, key), seq_len)
        if seq_len % block:
            return f"{key}={block} does not divide the sequence length {seq_len}"
    return None


def splash_arguments(q, k, v, *, scale: float, window: int | None, softcap: float | None,
                     segment_ids, mesh, cfg: AttentionConfig) -> dict:
    spec = cfg.qkv_partition_spec or default_qkv_spec(q.shape[1], mesh)
    layer_cfg = dataclasses.replace(
        cfg.with_mesh(mesh), qkv_partition_spec=spec,
        attentiontype_local_sliding=window is not None,
        slide_window_size=None if window is None else window - 1)
    return dict(q=q * scale, k=k, v=v, config=splash_json(layer_cfg),
                decoder_segment_ids=segment_ids, causal=True, attn_logits_soft_cap=softcap)


def splash_json(cfg: AttentionConfig) -> str:
    """torch_xla's SplashAttentionConfig JSON: every field but AutoXLA's own ``layers``."""
    import json

    fields = dataclasses.asdict(cfg)
    fields.pop("layers")
    return json.dumps(fields)


def run_splash(arguments: dict) -> torch.Tensor:
    from torch_xla.experimental.splash_attention import splash_attention

    a = dict(arguments)
    return splash_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("config"), **a)
