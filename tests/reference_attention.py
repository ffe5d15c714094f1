"""The test oracle for AutoXLA.attention: dense attention in float64, written for obviousness.

Nothing blockwise, nothing online: repeat the kv heads, build the whole [B, Hq, Sq, Skv] score
matrix, mask it, take one softmax. Semantics (those stated in AutoXLA/attention/blockwise.py):

    logits      = scale * q.k, then softcap * tanh(logits / softcap) when softcap is set,
                  then + mask when mask is a float tensor (-inf entries count as disallowed)
    allowed(i,j) = (not causal or j <= i + q_offset)
                   and (window is None or (i + q_offset) - j < window)
                   and (no segment ids or q_segment_ids[b, i] == kv_segment_ids[b, j])
                   and (mask is not bool or mask[b, h, i, j])
    out         = softmax over the allowed keys of each row, times v; a row with no allowed key is
                  what transformers' eager attention gives it: its logits plus finfo(float32).min,
                  which absorbs them (a uniform softmax: the mean of v over all Skv keys) while
                  autograd still differentiates them. With a soft-cap such a row gives q and k no
                  gradient (AutoXLA's documented difference: blockwise.no_key_rows)
    GQA         = query head h reads kv head h // (Hq // Hkv)

Inputs may have any float dtype and may require grad; the result is float64 (differentiable).
Import it as ``from tests.reference_attention import reference_attention``.
"""

from __future__ import annotations

import torch


def reference_attention(q, k, v, *, scale, causal=False, window=None, softcap=None,
                        q_segment_ids=None, kv_segment_ids=None, mask=None, q_offset=0):
    """Dense float64 attention of q [B, Hq, Sq, D] over k, v [B, Hkv, Skv, D] -> [B, Hq, Sq, D]."""
    q, k, v = q.double(), k.double(), v.double()
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)  # head h of the result is kv head h // group
    v = v.repeat_interleave(group, dim=1)
    sq, skv = q.shape[2], k.shape[2]

    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hq, Sq, Skv]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    # Eager's row with nothing allowed: every logit plus finfo.min, which absorbs them in value
    # (float64's spacing there is ~4e22) but not in autograd.
    unmasked = scores if softcap is None else scores.detach()
    nothing_allowed = unmasked + torch.finfo(torch.float32).min

    i = torch.arange(sq).view(sq, 1) + q_offset  # absolute query positions
    j = torch.arange(skv).view(1, skv)
    allowed = torch.ones(sq, skv, dtype=torch.bool)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (i - j < window)
    allowed = allowed.view(1, 1, sq, skv)
    if q_segment_ids is not None:
        same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]  # [B, Sq, Skv]
        allowed = allowed & same[:, None]
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            mask = mask.double()
            scores = scores + mask
            allowed = allowed & ~torch.isneginf(mask)
    allowed = allowed.expand(scores.shape)

    any_allowed = allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    # A row with nothing allowed would be softmax(all -inf) = NaN (and NaN gradients): eager's.
    scores = torch.where(any_allowed, scores, nothing_allowed)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v)
