"""Portable blockwise attention: online softmax over static blocks, in plain torch ops.

This is what ``xla_flash_attention`` and ``splash_attention`` run wherever torch_xla's Pallas
kernels cannot (anything but a TPU), with the kernels' semantics:

    allowed(i, j) = (not causal or j <= i + q_offset)
                    and (window is None or (i + q_offset) - j < window)
                    and (segment ids absent or q_segment_ids[i] == kv_segment_ids[j])
                    and (mask absent or mask[i, j])          # a bool mask; a float mask is added,
                                                             # entries <= -1e30 count as masked

with logits ``softcap * tanh(scale * q.k / softcap)`` when a soft-cap is set. ``window`` counts the
query's own position (window=1 sees only itself), as transformers' sliding windows do. A query row
with no allowed key returns the mean of v over all ``Skv`` keys, as transformers' eager attention
does (its masked logits are all ``finfo.min``, which absorbs the scores, so its softmax is
uniform): a left-padded row's pads have no allowed key, and the last pad's output is in a
language model's loss (it predicts the first real token). Its gradient is eager's too, and finite
(``no_key_rows``).

Grouped-query attention is computed without repeating k and v: the query heads of a group are
stacked as extra rows against their one kv head. Block shapes are static (the sequence is padded
to whole blocks), and the blocks that causality and the window remove entirely are never built
into the graph, so XLA compiles one program per shape and skips that work (``schedule``).
Scores, softmax and the output accumulate in float32 whatever the input dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Masked logits: finite, so a row with nothing allowed yet gives exp(0) (then discarded) rather
# than exp(-inf - -inf) = NaN, whose gradient would poison the backward pass even where unused.
_MASKED = -1e30


@dataclass(frozen=True)
class Schedule:
    """Which kv blocks each query block visits: static, from shapes and the mask's structure."""

    block_q: int
    block_kv: int
    q_blocks: int
    kv_blocks: int
    visits: tuple[tuple[int, int], ...]   # per query block: [first, last) kv block

    @property
    def computed(self) -> int:
        return sum(hi - lo for lo, hi in self.visits)

    @property
    def skipped_fraction(self) -> float:
        return 1.0 - self.computed / (self.q_blocks * self.kv_blocks)


def schedule(q_len: int, kv_len: int, block_q: int, block_kv: int, *, causal: bool,
             window: int | None = None, q_offset: int = 0) -> Schedule:
    """The kv blocks each query block must visit; every other block is entirely masked."""
    if causal is False and window is not None:
        raise ValueError("window= needs causal=True: the window reaches back from each query, "
                         "as transformers' sliding windows do")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (it counts the query itself), got {window}")
    bq, bk = min(block_q, q_len), min(block_kv, kv_len)
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    visits = []
    for i in range(nq):
        first_row, last_row = i * bq + q_offset, min((i + 1) * bq, q_len) - 1 + q_offset
        hi = nk if not causal else max(0, min(nk, last_row // bk + 1))
        lo = 0 if window is None else max(0, (first_row - window + 1) // bk)
        visits.append((min(lo, hi), hi))
    return Schedule(bq, bk, nq, nk, tuple(visits))


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                        causal: bool = False, window: int | None = None,
                        softcap: float | None = None, q_segment_ids: torch.Tensor | None = None,
                        kv_segment_ids: torch.Tensor | None = None,
                        mask: torch.Tensor | None = None, q_offset: int = 0,
                        block_q: int = 512, block_kv: int = 512) -> torch.Tensor:
    """Attention of q [B, Hq, Sq, D] over k, v [B, Hkv, Skv, D] (Hq a multiple of Hkv).

    Returns [B, Hq, Sq, D] in q's dtype. ``mask`` is [B or 1, 1 or Hq, Sq, Skv], bool (True =
    allowed) or float (added to the logits, as transformers' eager attention does); segment ids
    are [B, Sq] and [B, Skv] integers.
    """
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need "
                         "q [B, Hq, Sq, D] and k, v [B, Hkv, Skv, D] with Hq a multiple of Hkv")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if mask is not None and (mask.dim() != 4 or mask.shape[0] not in (1, b)
                             or mask.shape[1] not in (1, hq) or tuple(mask.shape[2:]) != (sq, skv)):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; it must be [{b} or 1, 1 or {hq}, "
                         f"{sq}, {skv}] ([batch, heads, queries, keys])")
    plan = schedule(sq, skv, block_q, block_kv, causal=causal, window=window, q_offset=q_offset)
    bq, bk, g = plan.block_q, plan.block_kv, hq // hkv
    pad_q, pad_kv = plan.q_blocks * bq - sq, plan.kv_blocks * bk - skv

    def pad(t, dim, n, value=0):
        if n == 0:
            return t
        shape = list(t.shape)
        shape[dim] = n
        return torch.cat([t, t.new_full(shape, value)], dim=dim)

    # [B, Hkv, G, Sq, D] in float32: the G query heads of a kv head become rows against it.
    qf = pad(q.float().reshape(b, hkv, g, sq, d), 3, pad_q)
    kf, vf = pad(k.float(), 2, pad_kv), pad(v.float(), 2, pad_kv)
    if q_segment_ids is not None:
        q_seg, kv_seg = pad(q_segment_ids, 1, pad_q), pad(kv_segment_ids, 1, pad_kv)
    if mask is not None:
        mask = pad(pad(mask, 2, pad_q, False if mask.dtype == torch.bool else 0), 3, pad_kv,
                   False if mask.dtype == torch.bool else 0)
        if mask.shape[1] == hq:            # per-head mask -> [B, Hkv, G, ...]
            mask = mask.reshape(mask.shape[0], hkv, g, *mask.shape[2:])
        else:
            mask = mask.unsqueeze(2)       # [B|1, 1, 1, Sq, Skv]
    rows_all = torch.arange(plan.q_blocks * bq, device=q.device) + q_offset
    cols_all = torch.arange(plan.kv_blocks * bk, device=q.device)
    # What a row with no allowed key returns: eager's (no_key_rows), over the real keys only.
    no_key = _NoKeyRows(q, k, kf[:, :, :skv], vf[:, :, :skv], scale, softcap)

    outputs = []
    for i, (lo, hi) in enumerate(plan.visits):
        r0, r1 = i * bq, (i + 1) * bq
        qb = qf[:, :, :, r0:r1].reshape(b, hkv, g * bq, d)
        if lo == hi:
            # Every key is masked for this block: eager's rows, kept attached to q, k and v so
            # that autograd never refuses an unused input.
            attached = qb * 0.0 + kf[:, :, :1].sum() * 0.0
            outputs.append((attached + no_key(qb)).reshape(b, hkv, g, bq, d))
            continue
        m = qb.new_full((b, hkv, g * bq), _MASKED)
        l = qb.new_zeros((b, hkv, g * bq))
        acc = qb.new_zeros((b, hkv, g * bq, d))
        for j in range(lo, hi):
            c0, c1 = j * bk, (j + 1) * bk
            s = torch.matmul(qb, kf[:, :, c0:c1].transpose(-1, -2)) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            s = s.reshape(b, hkv, g, bq, bk)
            allowed = _structural(rows_all[r0:r1], cols_all[c0:c1], causal, window, skv,
                                  rows=(r0 + q_offset, r1 - 1 + q_offset), cols=(c0, c1 - 1))
            if q_segment_ids is not None:
                same = q_seg[:, r0:r1, None] == kv_seg[:, None, c0:c1]       # [B, bq, bk]
                same = same[:, None, None]
                allowed = same if allowed is None else allowed & same
            if mask is not None:
                block = mask[..., r0:r1, c0:c1]
                if block.dtype == torch.bool:
                    allowed = block if allowed is None else allowed & block
                else:
                    s = s + block.float()
            if allowed is not None:
                s = torch.where(allowed, s, _MASKED)
            s = s.reshape(b, hkv, g * bq, bk)
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row with nothing allowed so far has m_new == _MASKED and p == 1 on masked keys:
            # the first allowed key rescales that away (alpha = 0), and rows that never see one
            # take eager's value below, which is cheaper than masking p in every partial block.
            p = torch.exp(s - m_new.unsqueeze(-1))
            alpha = torch.exp(m - m_new)
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, vf[:, :, c0:c1])
            m = m_new
        # l is 0 where every logit was -inf (a float mask): divide by 1 there, or the division's
        # gradient is 0 * inf = NaN even though where() discards the row.
        safe_l = torch.where(l == 0, 1.0, l).unsqueeze(-1)
        out = torch.where((m > _MASKED).unsqueeze(-1), acc / safe_l, no_key(qb))
        outputs.append(out.reshape(b, hkv, g, bq, d))
    out = torch.cat(outputs, dim=3)[:, :, :, :sq]
    return out.reshape(b, hq, sq, d).to(q.dtype)


def no_key_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                softcap: float | None = None) -> torch.Tensor:
    """[B, Hq, Sq, D] float32: what transformers' eager attention gives every query row of q when
    the row has no allowed key among k, v [B, Hkv, Skv, D] (for the TPU kernels' wrapper, which
    puts it in the rows the kernel cannot express: attention/hf.py).

    Eager adds finfo.min to every masked logit. When all of a row's are masked, finfo.min absorbs
    the scores (|s| is far below its spacing, ~2e31), so the softmax is uniform and the row is v's
    mean over all Skv keys. Autograd still differentiates the scores under the constant, so the
    row's gradient is a softmax's at uniform weights: d out_i / d s_ij = (v_j - mean v) / Skv.
    Here that gradient comes from ``x - x.detach()`` (zero in value) with
    ``x = scale * q_i . sum_j k_j (v_j - mean v) / Skv``: one [D, D] matrix per kv head, not the
    row's Skv scores. With a logit soft-cap eager's gradient also has each pair's tanh
    derivative, which needs every score; those rows then give q and k no gradient."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    rows = _NoKeyRows(q, k, k.float(), v.float(), scale, softcap)
    out = rows(q.float().reshape(b, hkv, (hq // hkv) * sq, d))
    return out.expand(b, hkv, (hq // hkv) * sq, d).reshape(b, hq, sq, d)


class _NoKeyRows:
    """no_key_rows for rows [B, Hkv, R, D] of the query heads a kv head serves (R = G x rows)."""

    def __init__(self, q, k, kf, vf, scale, softcap):
        self.mean = vf.mean(dim=2, keepdim=True)                           # [B, Hkv, 1, D]
        self.scale, self.cross = scale, None
        wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        if wants_grad and softcap is None:
            # sum_j k_j (v_j - mean v)^T / Skv: [B, Hkv, D, D]; v's part detached (in eager it
            # is the softmax's gradient that reaches v, which the mean already gives).
            self.cross = kf.transpose(-1, -2) @ (vf - self.mean).detach() / kf.shape[2]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if self.cross is None:
            return self.mean
        x = (rows @ self.cross) * self.scale
        return self.mean + (x - x.detach())


def _structural(row_ids, col_ids, causal, window, kv_len, *, rows, cols):
    """The [bq, bk] mask that causality, the window and kv padding impose on one block, or None
    when the block is entirely allowed. Decided from the block's static corners (``rows`` and
    ``cols`` are its first and last indices), so full blocks cost no mask ops."""
    (first_row, last_row), (first_col, last_col) = rows, cols
    needs = (last_col >= kv_len or (causal and last_col > first_row)
             or (window is not None and last_row - first_col >= window))
    if not needs:
        return None
    r, c = row_ids[:, None], col_ids[None, :]
    allowed = c < kv_len
    if causal:
        allowed = allowed & (c <= r)
    if window is not None:
        allowed = allowed & (r - c < window)
    return allowed
