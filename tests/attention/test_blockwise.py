"""AutoXLA.attention.blockwise against the dense float64 oracle (tests/reference_attention.py).

  (a) property tests (Hypothesis) of the forward pass over random shapes: batch 1-2, 1-3 kv heads
      with 1-3 query heads each (GQA), sequences of 1-70, head dims 4/8/16, blocks of 1-32 (larger
      than the sequence and non-dividing included), causal or not, sliding windows, soft-caps,
      packed-sequence and padding-like segment ids, q_offset (decode, chunked prefill, and
      offsets that leave rows with nothing allowed, which take v's mean over every key, as
      transformers' eager attention gives them);
  (b) bool masks (shared and per head) and float additive masks (-inf entries included);
  (c) bfloat16 inputs: a bfloat16 result within one bfloat16 rounding of the oracle;
  (d) gradients wrt q, k, v against the oracle's float64 autograd, fully masked rows included;
  (e) ``schedule``: hand-worked visits, the 4096/512 skipped fractions, and a brute-force check
      that no skipped block holds an allowed (query, key) pair;
  (f) one run on the XLA device: the same answer, and a second call with new values compiles
      nothing;
  (g) argument errors.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from AutoXLA.attention.blockwise import blockwise_attention, schedule
from tests.helpers import assert_close
from tests.reference_attention import reference_attention

# ---- tolerances, with their reasons ------------------------------------------------------
# Forward, float32 vs the float64 oracle, inputs ~N(0, 1), scale = D^-1/2: logits are O(1-10),
# outputs are convex combinations of v rows (|out| <= max |v| ~ 5). Each float32 op rounds by
# 2^-24 relative; a logit picks up ~D of them (the dot product), the online softmax a few more
# per visited kv block (the rescale exp(m - m_new) and the running sums l, acc), over at most
# ~70 blocks. That is at most a few hundred ulps of O(1) values, i.e. ~1e-5 in the worst case
# and ~1e-6 in practice (observed max over the property tests: 7.6e-7, 5.5e-7 with masks).
# 2e-5 absolute plus 1e-5 relative leaves >10x margin over what is seen, while a wrong mask,
# block, head or offset moves outputs by O(0.1-1).
FWD_ATOL = 2e-5
FWD_RTOL = 1e-5
# bfloat16 inputs: the kernel widens them to float32 (exactly), computes as above, and rounds
# the float32 result y once to bfloat16. The oracle sees the same bfloat16 values in float64,
# so |got - ref| <= |round(y) - y| + |y - ref| <= 2^-8 |y| + FWD bound (bfloat16 has 8 significant
# bits, so round-to-nearest moves y by at most 2^-8 relative), and |y| <= |ref| + FWD bound.
# (Observed: |got - ref| - 2^-8 |ref| <= 2e-8, max |got - ref| 7.8e-3.)
BF16_RTOL = 2.0**-8 + FWD_RTOL * (1 + 2.0**-8)
BF16_ATOL = FWD_ATOL * (1 + 2.0**-8)
# Gradients, float32 autograd vs float64 autograd, of sum(w * out) with w ~N(0, 1): the backward
# pass recomputes softmax-weighted sums of the same size as the forward's, so the same few
# hundred ulps, but on gradients up to ~20 in magnitude (observed max |grad| 20, observed max
# error 5.3e-6). 1e-4 absolute + 1e-4 relative keeps >10x margin; a wrong gradient (a dropped
# mask, a block counted twice) is off by O(0.1-1).
GRAD_ATOL = 1e-4
GRAD_RTOL = 1e-4

# Sequences up to 70 with blocks down to 1 would make up to 4900 block pairs, each a dozen
# Python-dispatched ops; the smallest block is kept >= ceil(S / 10) so a case costs <= 100
# block pairs (blocks of 1-6 still come up with sequences of up to 10-60).
MAX_BLOCKS_PER_DIM = 10

PROPERTY_SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
SMALL_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---- random cases ------------------------------------------------------------------------


@dataclass
class Case:
    batch: int
    kv_heads: int
    group: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool
    window: int | None
    softcap: float | None
    q_offset: int
    segments: str | None  # None, "packed" (sorted ids 0-3) or "padding" (left-padding 0/1 ids)
    block_q: int
    block_kv: int
    seed: int
    mask: str | None = None  # None, "bool", "bool_per_head", "float", "float_per_head"

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.group


MASK_KINDS = ["bool", "bool_per_head", "float", "float_per_head"]


def _blocks(draw, length: int) -> int:
    return draw(st.integers(max(1, -(-length // MAX_BLOCKS_PER_DIM)), 32))


@st.composite
def cases(draw, masks: bool | None = False) -> Case:
    """masks: False never draws a mask, True always does, None sometimes."""
    causal = draw(st.booleans())
    kv_len = draw(st.integers(1, 70))
    window = None
    if causal:
        kind = draw(st.sampled_from(["square", "suffix", "any"]))
        if kind == "square":  # self-attention over one sequence
            q_len, q_offset = kv_len, 0
        elif kind == "suffix":  # decode (q_len 1) or chunked prefill: the queries end the keys
            q_len = draw(st.sampled_from([1]) | st.integers(1, kv_len))
            q_offset = kv_len - q_len
        else:  # any offset, even negative or past the end: some rows may see no key at all
            q_len = draw(st.integers(1, 70))
            q_offset = draw(st.integers(-q_len - 2, kv_len + 2))
        window = draw(st.none() | st.integers(1, kv_len + 2))
    else:
        q_len = draw(st.integers(1, 70))
        q_offset = draw(st.sampled_from([0, 0, -3, 5]))  # without causal, q_offset is inert
    return Case(
        batch=draw(st.integers(1, 2)), kv_heads=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 3)), q_len=q_len, kv_len=kv_len,
        head_dim=draw(st.sampled_from([4, 8, 16])), causal=causal, window=window,
        softcap=draw(st.none() | st.sampled_from([0.5, 5.0, 50.0])), q_offset=q_offset,
        segments=draw(st.sampled_from([None, "packed", "padding"])),
        block_q=_blocks(draw, q_len), block_kv=_blocks(draw, kv_len),
        seed=draw(st.integers(0, 2**31 - 1)),
        mask=draw(st.sampled_from(MASK_KINDS) if masks else
                  st.none() | st.sampled_from(MASK_KINDS) if masks is None else st.none()),
    )


def _segment_ids(kind: str, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    if kind == "packed":  # several sequences packed one after another
        return torch.sort(torch.randint(0, 4, (batch, length), generator=g), dim=1).values
    pad = torch.randint(0, length + 1, (batch, 1), generator=g)  # left padding: 0 then 1
    return (torch.arange(length).view(1, length) >= pad).long()


def make_inputs(c: Case, dtype=torch.float32):
    """q, k, v and the keyword arguments shared by blockwise_attention and the oracle."""
    g = torch.Generator().manual_seed(c.seed)
    q = torch.randn(c.batch, c.q_heads, c.q_len, c.head_dim, generator=g).to(dtype)
    k = torch.randn(c.batch, c.kv_heads, c.kv_len, c.head_dim, generator=g).to(dtype)
    v = torch.randn(c.batch, c.kv_heads, c.kv_len, c.head_dim, generator=g).to(dtype)
    kw = dict(scale=c.head_dim**-0.5, causal=c.causal, window=c.window, softcap=c.softcap,
              q_offset=c.q_offset)
    if c.segments is not None:
        kv_seg = _segment_ids(c.segments, c.batch, c.kv_len, g)
        # Self-attention shares the ids; otherwise the queries get their own, so some of them
        # may belong to a segment with no key (rows with nothing allowed).
        same = c.q_len == c.kv_len and c.q_offset == 0
        q_seg = kv_seg if same else _segment_ids(c.segments, c.batch, c.q_len, g)
        kw.update(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    if c.mask is not None:
        heads = c.q_heads if c.mask.endswith("per_head") else 1
        shape = (c.batch, heads, c.q_len, c.kv_len)
        if c.mask.startswith("bool"):
            mask = torch.rand(shape, generator=g) < 0.7
            mask[:, :, ::5] = False  # every fifth query row sees nothing
        else:  # an additive bias, with some -inf entries and every fifth row entirely -inf
            mask = 2 * torch.randn(shape, generator=g)
            mask = mask.masked_fill(torch.rand(shape, generator=g) < 0.3, float("-inf"))
            mask[:, :, ::5] = float("-inf")
        kw["mask"] = mask
    return q, k, v, kw


def blockwise(c: Case, q, k, v, kw):
    return blockwise_attention(q, k, v, block_q=c.block_q, block_kv=c.block_kv, **kw)


# ---- (a), (b) forward against the oracle -------------------------------------------------


@PROPERTY_SETTINGS
@given(cases())
def test_matches_reference(c):
    q, k, v, kw = make_inputs(c)
    out = blockwise(c, q, k, v, kw)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert_close(out, reference_attention(q, k, v, **kw), FWD_ATOL, FWD_RTOL, what=repr(c))


@SMALL_SETTINGS
@given(cases(masks=True))
def test_masks_match_reference(c):
    q, k, v, kw = make_inputs(c)
    out = blockwise(c, q, k, v, kw)
    assert_close(out, reference_attention(q, k, v, **kw), FWD_ATOL, FWD_RTOL, what=repr(c))


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_mask_kinds(kind):
    # Fixed cases of each mask kind (the Hypothesis test above mixes them with everything else):
    # GQA, causal, non-dividing blocks, and rows masked entirely.
    c = Case(batch=2, kv_heads=2, group=2, q_len=13, kv_len=13, head_dim=8, causal=True,
             window=None, softcap=None, q_offset=0, segments=None, block_q=4, block_kv=5,
             seed=7, mask=kind)
    q, k, v, kw = make_inputs(c)
    out = blockwise(c, q, k, v, kw)
    assert_close(out, reference_attention(q, k, v, **kw), FWD_ATOL, FWD_RTOL, what=kind)
    # The rows masked entirely: v's mean over all keys, each query head its kv head's.
    mean = v.mean(dim=2, keepdim=True).repeat_interleave(c.group, dim=1)
    assert_close(out[:, :, ::5], mean.expand_as(out[:, :, ::5]), FWD_ATOL, FWD_RTOL, what=kind)


def test_mask_broadcast_over_batch():
    # A [1, 1, Sq, Skv] mask serves every batch element.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=g) for _ in range(3))
    mask = torch.rand(1, 1, 9, 9, generator=g) < 0.5
    out = blockwise_attention(q, k, v, scale=0.5, mask=mask, block_q=4, block_kv=4)
    assert_close(out, reference_attention(q, k, v, scale=0.5, mask=mask), FWD_ATOL, FWD_RTOL)


def test_float_mask_of_finfo_min_counts_as_masked():
    # transformers' additive masks use finfo.min for "masked": float mask entries <= -1e30
    # disallow the key. A row masked everywhere is what eager gives it, the uniform average (its
    # scores vanish next to finfo.min; issue 43: a left-padded row's last pad is in the loss),
    # and a partly masked row is exact.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 3, 4, generator=g) for _ in range(3))
    mask = torch.zeros(1, 1, 3, 3)
    mask[0, 0, 1] = torch.finfo(torch.float32).min
    mask[0, 0, 2, 0] = torch.finfo(torch.float32).min
    out = blockwise_attention(q, k, v, scale=0.5, mask=mask, block_q=2, block_kv=2)
    eager = torch.softmax(q @ k.transpose(-1, -2) * 0.5 + mask, dim=-1) @ v
    assert_close(eager[0, 0, 1], v[0, 0].mean(dim=0), FWD_ATOL, FWD_RTOL, what="eager's row")
    assert_close(out, eager, FWD_ATOL, FWD_RTOL)


def test_left_padding_is_transformers_eager_forward_and_gradients():
    # Issue 43, against transformers itself rather than the oracle: its own eager attention
    # (Llama's eager_attention_forward) with its own mask (causal + left padding, eager_mask)
    # on a GQA batch whose second row starts with 3 pads, which have no allowed key. AutoXLA's
    # portable path masks padding as transformers does (padded keys for every query:
    # q_segment_ids all ones) and gives those rows eager's value and gradients. Tolerances: the
    # forward ones of this file; gradients of sum(w * out) through a softmax over 10 keys, same
    # few-ulp argument, 2e-5 absolute (observed < 1e-6).
    from types import SimpleNamespace

    from transformers.masking_utils import eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    g = torch.Generator().manual_seed(43)
    q, k, v = (torch.randn(2, h, 10, 8, generator=g) for h in (4, 2, 2))
    w = torch.randn(2, 4, 10, 8, generator=g)
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, :3] = 0
    scale = 8 ** -0.5

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad((out * w).sum(), leaves))

    mask = eager_mask(batch_size=2, q_length=10, kv_length=10, attention_mask=padding.bool())
    module = SimpleNamespace(num_key_value_groups=2, training=False)
    want = grads(lambda q, k, v: eager_attention_forward(module, q, k, v, mask, scale)[0]
                 .transpose(1, 2))
    got = grads(lambda q, k, v: blockwise_attention(
        q, k, v, scale=scale, causal=True, q_segment_ids=torch.ones_like(padding),
        kv_segment_ids=padding, block_q=4, block_kv=4))
    assert_close(got[0], want[0], FWD_ATOL, FWD_RTOL, what="output")
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert_close(a, b, 2e-5, FWD_RTOL, what=name)
    # The pads' rows: v's mean over all 10 keys, and a gradient wrt their queries.
    assert_close(want[0][1, :, :3], v[1].mean(dim=1).repeat_interleave(2, dim=0)[:, None]
                 .expand(4, 3, 8), FWD_ATOL, FWD_RTOL, what="eager's pad rows")
    assert want[1][1, :, :3].abs().amax() > 1e-3
    # transformers' sdpa (torch >= 2.5) gives those rows zeros instead: the two of transformers'
    # implementations differ there; AutoXLA follows eager, its own default (docs/attention.md).
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=mask == 0, scale=scale)
    assert torch.equal(sdpa[1, :, :3], torch.zeros(4, 3, 8))


# ---- (c) bfloat16 ------------------------------------------------------------------------


@SMALL_SETTINGS
@given(cases())
def test_bfloat16(c):
    q, k, v, kw = make_inputs(c, torch.bfloat16)
    out = blockwise(c, q, k, v, kw)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert_close(out, reference_attention(q, k, v, **kw), BF16_ATOL, BF16_RTOL, what=repr(c))


# ---- (d) gradients -----------------------------------------------------------------------


def check_gradients(c: Case, q, k, v, kw):
    """Blockwise float32 gradients vs the oracle's float64 ones; returns (out, grads)."""
    g = torch.Generator().manual_seed(c.seed + 1)
    w = torch.randn(c.batch, c.q_heads, c.q_len, c.head_dim, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = blockwise(c, *leaves, kw)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves64, **kw)
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), leaves64)
    assert_close(out, ref, FWD_ATOL, FWD_RTOL, what=f"{c} output")
    for name, got, want in zip("qkv", grads, ref_grads):
        assert_close(got, want, GRAD_ATOL, GRAD_RTOL, what=f"{c} d{name}")  # finite, too
    return out, grads


@SMALL_SETTINGS
@given(cases(masks=None))
def test_gradients_match_reference(c):
    check_gradients(c, *make_inputs(c))


def test_gradient_when_every_block_is_skipped():
    # causal with q_offset=-Sq: every query precedes every key, every block is skipped; v's
    # mean, with eager's gradients.
    c = _row_case(q_offset=-6)
    check_gradients(c, *make_inputs(c))


def _row_case(**kw) -> Case:
    base = dict(batch=1, kv_heads=1, group=2, q_len=6, kv_len=6, head_dim=4, causal=True,
                window=None, softcap=None, q_offset=0, segments=None, block_q=2, block_kv=4,
                seed=11)
    return Case(**{**base, **kw})


# Each case leaves the rows listed with no allowed key at all.
EMPTY_ROWS = {
    # q_offset -2: queries 0 and 1 sit at positions -2, -1, before every key.
    "causal_negative_offset": (_row_case(q_offset=-2), [0, 1]),
    # queries at positions 7..12 over 6 keys with a window of 3: positions >= 8 see nothing.
    "window_past_the_end": (_row_case(kv_len=6, q_offset=7, window=3, block_kv=3), [1, 2, 3, 4, 5]),
    # query segment 2 has no key.
    "segment_without_keys": (_row_case(causal=False), [4, 5]),
    # a bool mask row that is all False.
    "masked_row": (_row_case(causal=False, mask="bool"), [0, 5]),
}


@pytest.mark.parametrize("name", list(EMPTY_ROWS))
def test_gradients_with_fully_masked_rows(name):
    c, empty = EMPTY_ROWS[name]
    q, k, v, kw = make_inputs(c)
    if name == "segment_without_keys":
        kw.update(q_segment_ids=torch.tensor([[0, 0, 1, 1, 2, 2]]),
                  kv_segment_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]))
    out, (dq, dk, dv) = check_gradients(c, q, k, v, kw)
    # Rows with nothing allowed: v's mean over all keys (eager's uniform softmax), and the
    # gradients eager gives them (check_gradients compared them with the oracle's): not zero
    # wrt their queries, since autograd differentiates the scores under eager's finfo.min.
    mean = v.mean(dim=2, keepdim=True).repeat_interleave(c.group, dim=1)
    assert_close(out[:, :, empty], mean.expand_as(out[:, :, empty]), FWD_ATOL, FWD_RTOL, what=name)
    assert dq[:, :, empty].abs().amax() > 1e-3, name


# ---- (e) schedule ------------------------------------------------------------------------


@pytest.mark.parametrize("args, kw, visits", [
    # Causal, 4 blocks of 1: the lower triangle.
    ((4, 4, 1, 1), dict(causal=True), ((0, 1), (0, 2), (0, 3), (0, 4))),
    # Not causal: everything.
    ((4, 4, 1, 1), dict(causal=False), ((0, 4),) * 4),
    # Non-dividing: 5 rows in blocks of 2 (the last block holds row 4 only).
    ((5, 5, 2, 2), dict(causal=True), ((0, 1), (0, 2), (0, 3))),
    # Blocks larger than the sequence shrink to it: one block.
    ((3, 3, 8, 8), dict(causal=True), ((0, 1),)),
    # 8 positions in blocks of 2. window 1: only the diagonal block.
    ((8, 8, 2, 2), dict(causal=True, window=1), ((0, 1), (1, 2), (2, 3), (3, 4))),
    # window 2: row 2i also sees 2i - 1, in the block before.
    ((8, 8, 2, 2), dict(causal=True, window=2), ((0, 1), (0, 2), (1, 3), (2, 4))),
    # window 3: rows 2i, 2i + 1 reach back to 2i - 2 at most: still one block back.
    ((8, 8, 2, 2), dict(causal=True, window=3), ((0, 1), (0, 2), (1, 3), (2, 4))),
    # window 4: row 2i reaches 2i - 3, two blocks back.
    ((8, 8, 2, 2), dict(causal=True, window=4), ((0, 1), (0, 2), (0, 3), (1, 4))),
    # Decode: one query at position 9 over 10 keys in blocks of 4: all 3 blocks...
    ((1, 10, 4, 4), dict(causal=True, q_offset=9), ((0, 3),)),
    # ... with a window of 3 it sees keys 7..9: blocks 1 and 2.
    ((1, 10, 4, 4), dict(causal=True, q_offset=9, window=3), ((1, 3),)),
    # Chunked prefill: queries 8..11 over 12 keys.
    ((4, 12, 4, 4), dict(causal=True, q_offset=8), ((0, 3),)),
    # Queries 8, 9 reach back to 5, queries 10, 11 to 7: both blocks start at kv block 1.
    ((4, 12, 2, 4), dict(causal=True, q_offset=8, window=4), ((1, 3), (1, 3))),
    # Negative offset: queries at -2, -1 see nothing, queries at 0, 1 the first block.
    ((4, 4, 2, 2), dict(causal=True, q_offset=-2), ((0, 0), (0, 1))),
])
def test_schedule_visits(args, kw, visits):
    plan = schedule(*args, **kw)
    assert plan.visits == visits
    assert plan.computed == sum(hi - lo for lo, hi in visits)


def test_schedule_causal_fraction():
    plan = schedule(4, 4, 1, 1, causal=True)
    assert (plan.computed, plan.skipped_fraction) == (10, 6 / 16)


def test_schedule_4096():
    # 8 x 8 blocks of 512. Causal: 1 + 2 + ... + 8 = 36 computed, 28 of 64 skipped.
    causal = schedule(4096, 4096, 512, 512, causal=True)
    assert (causal.q_blocks, causal.kv_blocks, causal.computed) == (8, 8, 36)
    assert causal.skipped_fraction == 28 / 64 == 0.4375
    # Window 1024: query block i (rows 512i .. 512i + 511) reaches back to 512i - 1023, inside
    # block i - 2, so it visits blocks max(0, i - 2) .. i: 1 + 2 + 3 * 6 = 21 computed.
    windowed = schedule(4096, 4096, 512, 512, causal=True, window=1024)
    assert windowed.visits == ((0, 1), (0, 2)) + tuple((i - 2, i + 1) for i in range(2, 8))
    assert windowed.computed == 21
    assert windowed.skipped_fraction == 43 / 64 == 0.671875


def _allowed(r: int, c: int, causal: bool, window: int | None, q_offset: int) -> bool:
    return ((not causal or c <= r + q_offset)
            and (window is None or (r + q_offset) - c < window))


def test_schedule_brute_force():
    # Over random small cases: (1) a block not visited holds no allowed (query, key) pair among
    # the real (unpadded) positions -- skipping it is exact; (2) a visited block holds at least
    # one. (2) fails only when a window is set and the queries run past the last key
    # (q_offset + q_len > kv_len): there the window can reach only into the kv padding of the
    # last block, which is still visited -- wasted work, not a wrong answer.
    rnd = random.Random(1234)
    wasted = 0
    for _ in range(3000):
        q_len, kv_len = rnd.randint(1, 12), rnd.randint(1, 12)
        block_q, block_kv = rnd.randint(1, 14), rnd.randint(1, 14)
        causal = rnd.random() < 0.8
        window = rnd.choice([None, rnd.randint(1, kv_len + 3)]) if causal else None
        q_offset = rnd.randint(-q_len - 2, kv_len + 3) if causal else 0
        plan = schedule(q_len, kv_len, block_q, block_kv, causal=causal, window=window,
                        q_offset=q_offset)
        bq, bk = plan.block_q, plan.block_kv
        assert (plan.q_blocks, plan.kv_blocks) == (-(-q_len // bq), -(-kv_len // bk))
        assert len(plan.visits) == plan.q_blocks
        for i, j in itertools.product(range(plan.q_blocks), range(plan.kv_blocks)):
            lo, hi = plan.visits[i]
            assert 0 <= lo <= hi <= plan.kv_blocks
            rows = range(i * bq, min((i + 1) * bq, q_len))
            cols = range(j * bk, min((j + 1) * bk, kv_len))
            some = any(_allowed(r, c, causal, window, q_offset) for r in rows for c in cols)
            case = (q_len, kv_len, block_q, block_kv, causal, window, q_offset, i, j)
            if not lo <= j < hi:
                assert not some, f"skipped block holds allowed pairs: {case}"
            elif not some:
                wasted += 1
                assert window is not None and q_offset + q_len > kv_len, (
                    f"visited block holds no allowed pair: {case}")
    assert wasted > 0  # the exception above does occur (it is documented, not hypothetical)


# ---- (f) on the XLA device ---------------------------------------------------------------


def test_on_xla_device_compiles_once(xla_devices):
    from AutoXLA import backend

    dev = backend.device()
    c = Case(batch=2, kv_heads=2, group=2, q_len=37, kv_len=37, head_dim=8, causal=True,
             window=20, softcap=30.0, q_offset=0, segments="packed", block_q=16, block_kv=8,
             seed=0)

    def run(seed):
        q, k, v, kw = make_inputs(Case(**{**c.__dict__, "seed": seed}))
        on_device = {n: t.to(dev) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
        out = blockwise(c, q.to(dev), k.to(dev), v.to(dev), on_device)
        return out, reference_attention(q, k, v, **kw)

    def step(seed):
        out, ref = run(seed)
        backend.sync()
        assert out.device.type == "xla"
        assert_close(out.cpu(), ref, FWD_ATOL, FWD_RTOL, what=f"on XLA, seed {seed}")

    # Two warm-up calls: the first one's graph also holds the pending input transfers.
    step(0)
    step(1)
    compiles = backend.compile_count()
    step(2)
    step(3)
    assert backend.compile_count() == compiles, "a call with new values compiled again"


# ---- (g) errors --------------------------------------------------------------------------


def _qkv(hq=2, hkv=1, sq=5, skv=6, d=4, b=1, dv=None, skv_v=None):
    return (torch.randn(b, hq, sq, d), torch.randn(b, hkv, skv, d),
            torch.randn(b, hkv, skv if skv_v is None else skv_v, d if dv is None else dv))


@pytest.mark.parametrize("qkv, kw, match", [
    (_qkv(skv_v=7), {}, "need q"),                                      # k, v lengths differ
    ((torch.randn(2, 2, 5, 4),) + _qkv()[1:], {}, "need q"),             # batch differs
    (_qkv(hq=3, hkv=2), {}, "multiple"),                                 # Hq % Hkv != 0
    (_qkv(), dict(q_segment_ids=torch.zeros(1, 5, dtype=torch.long)), "both"),
    (_qkv(), dict(kv_segment_ids=torch.zeros(1, 6, dtype=torch.long)), "both"),
    (_qkv(), dict(window=3), "causal"),
    (_qkv(), dict(softcap=0.0), "positive"),
    (_qkv(), dict(softcap=-1.0), "positive"),
    (_qkv(), dict(causal=True, window=0), "window"),
    (_qkv(), dict(mask=torch.ones(1, 3, 5, 6, dtype=torch.bool)), "heads"),
])
def test_errors(qkv, kw, match):
    with pytest.raises(ValueError, match=match):
        blockwise_attention(*qkv, scale=1.0, **kw)


def test_schedule_errors():
    with pytest.raises(ValueError, match="causal"):
        schedule(4, 4, 2, 2, causal=False, window=2)
    with pytest.raises(ValueError, match="window"):
        schedule(4, 4, 2, 2, causal=True, window=0)


@pytest.mark.parametrize("qkv, kw", [
    ((torch.randn(1, 1, 5, 8), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)), {}),
    (_qkv(dv=8), {}),
    (_qkv(dv=1), {}),
    (_qkv(), dict(mask=torch.ones(1, 1, 7, 6, dtype=torch.bool))),
    (_qkv(), dict(mask=torch.ones(1, 1, 5, 9, dtype=torch.bool))),
])
def test_mismatched_head_dims_and_mask_shapes_are_refused(qkv, kw):
    with pytest.raises(ValueError, match=r"need q \[B, Hq, Sq, D\]|mask has shape"):
        blockwise_attention(*qkv, scale=1.0, **kw)
