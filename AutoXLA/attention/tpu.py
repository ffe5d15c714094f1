"""The only module that calls torch_xla's Pallas attention kernels: on a TPU, or off one in
interpret mode (AutoXLA/kernels/interpret.py, how the tests run them).

Each kernel has an ``*_arguments`` function that builds exactly what the call receives, so the
translation from transformers' conventions is unit-tested on its own, and a ``run_*``
function that makes the call. A batch that does not fill whole shards of the spec's batch axes
is padded with zero rows, and a sequence the kernel's blocks cannot tile with zero positions at
the end (kernel_length), for the call; both are sliced off after it. Facts the translation relies on (TORCH_XLA_NOTES.md section 5):

- ``flash_attention(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale, partition_spec=,
  mesh=)``: [B, H, S, D], no GQA (kv heads are repeated here), no soft-cap, no window.
- Both split q, k and v by one spec, heads over its heads axes: how the heads are split (or kv
  heads repeated, or heads kept whole) is the plan's decision (sharding/attention_heads.py,
  ``plan.layer_attention.heads``), applied here.
- ``splash_attention(q, k, v, config_json, decoder_segment_ids, causal, attn_logits_soft_cap)``:
  GQA native, no ``sm_scale`` (q is pre-scaled), Sq == Skv, the mesh string inside the JSON, and a
  local window ``LocalMask(window_size=(w, w))`` that admits ``q - w <= k``: transformers' window
  ``W`` admits ``q - k < W``, so ``w = W - 1``.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..sharding.attention_heads import KernelHeads, kernel_heads
from ..sharding.mesh import validate_mesh_axes
from .config import AttentionConfig


def call_heads(kernel: str, q, k, mesh, cfg: AttentionConfig,
               heads: KernelHeads | None) -> KernelHeads:
    """The plan's head split for this call, checked against its shapes; decided here by the same
    rule when the plan has none (a config without head counts)."""
    if heads is None:
        shape = validate_mesh_axes(mesh.axis_names, mesh.mesh_shape, len(mesh.device_ids))
        return kernel_heads(kernel, q.shape[1], k.shape[1], shape, cfg.qkv_partition_spec)
    heads.check(q.shape[1], k.shape[1])
    return heads


def qkv_spec(heads: KernelHeads, cfg: AttentionConfig) -> tuple:
    """The kernels' q/k/v spec: the batch over (data, fsdp) (or the user's spec's batch and
    trailing entries) and the heads as ``heads`` splits them."""
    user = cfg.qkv_partition_spec
    if user is None:
        return (("data", "fsdp"), heads.spec_entry, None, None)
    return (user[0], heads.spec_entry, user[2], user[3])


def _repeat_kv(k, v, heads: KernelHeads):
    """transformers' repeat_kv order: kv head j becomes heads j*r .. j*r+r-1, so query head h
    (which read kv head h // G) reads repeated head h // (G/r), a copy of the same one."""
    if heads.kv_repeat == 1:
        return k, v
    return (k.repeat_interleave(heads.kv_repeat, dim=1),
            v.repeat_interleave(heads.kv_repeat, dim=1))


def batch_shards(spec: tuple, mesh) -> int:
    """How many pieces ``spec`` cuts the batch into on ``mesh``."""
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    axes = spec[0] if spec[0] is not None else ()
    axes = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([sizes.get(a, 1) for a in axes]))


def _pad_rows(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``t`` with zero rows appended to its batch up to ``rows``. Both kernels need whole
    shards: torch_xla's flash wrapper rebuilds the global shape as shard x mesh (1 row on 8
    devices came back as 8 and crashed the next matmul), and its splash wrapper asserts. A zero
    row attends uniformly over zero keys: finite, and sliced away after the call."""
    if t is None or t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def _whole_shards(spec: tuple, mesh, batch: int) -> int:
    shards = batch_shards(spec, mesh)
    return -(-batch // shards) * shards


def flash_supports(window: int | None, softcap: float | None) -> bool:
    """Pallas flash attention has neither a sliding window nor a logit soft-cap."""
    return window is None and softcap is None


def flash_arguments(q, k, v, *, scale: float, causal: bool, segment_ids, mesh,
                    cfg: AttentionConfig, heads: KernelHeads | None = None) -> dict:
    heads = call_heads("xla_flash_attention", q, k, mesh, cfg, heads)
    batch = q.shape[0]
    k, v = _repeat_kv(k, v, heads)     # flash has no GQA: to the query heads
    spec = qkv_spec(heads, cfg)
    rows, seq = _whole_shards(spec, mesh, q.shape[0]), q.shape[2]
    length = flash_length(seq)
    q, k, v = (_pad_positions(_pad_rows(t, rows), length, dim=2) for t in (q, k, v))
    segment_ids = _pad_positions(_pad_rows(segment_ids, rows), length, dim=1)
    return dict(q=q, k=k, v=v, causal=causal, q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids, sm_scale=scale, partition_spec=spec, mesh=mesh,
                rows=batch, positions=seq)


def run_flash(arguments: dict) -> torch.Tensor:
    from torch_xla.experimental.custom_kernel import flash_attention

    a = dict(arguments)
    rows, positions = a.pop("rows"), a.pop("positions")
    return flash_attention(a.pop("q"), a.pop("k"), a.pop("v"), **a)[:rows, :, :positions]


_SPLASH_BLOCKS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv",
                  "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")
LANES = 128   # splash's key blocks must be multiples of the TPU's lanes


def splash_length(seq_len: int, cfg: AttentionConfig) -> int:
    """The sequence length splash runs this call at (kernel_length over its blocks). Splash does
    not pad at all."""
    return kernel_length(seq_len, [getattr(cfg, key) for key in _SPLASH_BLOCKS])


def flash_length(seq_len: int) -> int:
    """The sequence length flash runs this call at (kernel_length over torch_xla's blocks).
    torch_xla's wrapper pads the keys to its key block but takes the block as min(512, length),
    so a 12-token call asked the kernel for 12-key blocks, which it refuses (whole lanes only)."""
    from torch_xla.experimental.custom_kernel import FlashAttention

    return kernel_length(seq_len, list(FlashAttention.DEFAULT_BLOCK_SIZES.values()),
                         ignore_below=LANES)


def kernel_length(seq_len: int, configured: list[int], ignore_below: int = 0) -> int:
    """The shortest length at or above ``seq_len`` that every block (min(configured, length))
    divides and whose blocks fill whole lanes (128). AutoXLA appends the positions, which no
    real query sees under the causal mask, and slices them off after the call. Blocks smaller
    than ``ignore_below`` (flash's batch block) are not sequence blocks."""
    configured = [b for b in configured if b >= ignore_below]
    length = -(-seq_len // LANES) * LANES
    while True:
        blocks = [min(b, length) for b in configured]
        if any(b % LANES for b in blocks):   # a configured block below the length, off the lanes
            raise ValueError(f"attention block sizes {sorted(set(configured))} include one that "
                             f"is not a multiple of {LANES}: the TPU kernels tile keys in whole "
                             "lanes; use multiples of 128 in attention_config")
        bad = [b for b in blocks if length % b]
        if not bad:
            return length
        length = -(-length // max(bad)) * max(bad)


def splash_arguments(q, k, v, *, scale: float, window: int | None, softcap: float | None,
                     segment_ids, mesh, cfg: AttentionConfig,
                     heads: KernelHeads | None = None) -> dict:
    heads = call_heads("splash_attention", q, k, mesh, cfg, heads)
    k, v = _repeat_kv(k, v, heads)     # only where the kv heads alone do not divide the axes
    spec = qkv_spec(heads, cfg)
    layer_cfg = dataclasses.replace(
        cfg.with_mesh(mesh), qkv_partition_spec=spec,
        attentiontype_local_sliding=window is not None,
        slide_window_size=None if window is None else window - 1)
    batch, rows = q.shape[0], _whole_shards(spec, mesh, q.shape[0])
    seq, length = q.shape[2], splash_length(q.shape[2], cfg)
    q, k, v = (_pad_positions(_pad_rows(t, rows), length, dim=2) for t in (q * scale, k, v))
    segment_ids = _pad_positions(_pad_rows(segment_ids, rows), length, dim=1)
    return dict(q=q, k=k, v=v, config=splash_json(layer_cfg),
                decoder_segment_ids=segment_ids, causal=True, attn_logits_soft_cap=softcap,
                rows=batch, positions=seq)


def _pad_positions(t: torch.Tensor | None, length: int, dim: int) -> torch.Tensor | None:
    if t is None or t.shape[dim] == length:
        return t
    shape = list(t.shape)
    shape[dim] = length - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def splash_json(cfg: AttentionConfig) -> str:
    """torch_xla's SplashAttentionConfig JSON: every field but AutoXLA's own ``layers``."""
    import json

    fields = dataclasses.asdict(cfg)
    fields.pop("layers")
    return json.dumps(fields)


def run_splash(arguments: dict) -> torch.Tensor:
    a = dict(arguments)
    rows, positions = a.pop("rows"), a.pop("positions")
    out = _Splash.apply(a["q"], a["k"], a["v"], a["config"], a["decoder_segment_ids"],
                        a["causal"], a["attn_logits_soft_cap"])
    return out[:rows, :, :positions]


class _Splash(torch.autograd.Function):
    """torch_xla's splash attention through its own forward and backward ops
    (``sa_custom_forward``/``sa_custom_backward``). Not its ``splash_attention``: that one passes
    the logit soft-cap, a float, to ``save_for_backward``, so every Gemma 2 call raised
    "save_for_backward can only save variables, but argument 4 is of type float" (torch_xla
    2.9.0; found running the kernel in interpret mode)."""

    @staticmethod
    def forward(ctx, q, k, v, config, segment_ids, causal, softcap):
        from torch_xla.experimental.splash_attention import sa_custom_forward

        ctx.save_for_backward(q, k, v, segment_ids)
        ctx.config, ctx.causal, ctx.softcap = config, causal, softcap
        return sa_custom_forward(q, k, v, config, segment_ids, causal, softcap)[0]

    @staticmethod
    def backward(ctx, grad_output):
        from torch_xla.experimental.splash_attention import sa_custom_backward

        q, k, v, segment_ids = ctx.saved_tensors
        dq, dk, dv = sa_custom_backward(grad_output, q, k, v, ctx.config, segment_ids,
                                        ctx.causal, ctx.softcap)
        return dq, dk, dv, None, None, None, None
