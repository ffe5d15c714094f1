"""Choosing the next token on the device: greedy, or temperature, top-k and top-p sampling.

Sampling is the Gumbel-max trick (argmax of logits + Gumbel noise draws from the softmax) with
noise from a counter-based hash of (seed, step, row, token id) in plain integer ops. So a draw
depends only on those four numbers: the same seed gives the same tokens whatever the batch bucket,
the sharding or the runtime's RNG state, and no RNG state needs to live on the device. The step
and seed are device data, so every step runs the same compiled program.

Filters follow transformers' warpers in their order (temperature, then top-k, then top-p).

A temperature below ``GREEDY_BELOW`` samples as temperature 0 does: greedily.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF

# Temperatures below this are greedy decoding (temperature 0, the limit they approach), as vLLM
# treats them (its _SAMPLING_EPS). Dividing float32 logits by a tinier one breaks: 1e-38 is
# subnormal and 1e-46 rounds to 0, so the scores become inf and NaN and their argmax is garbage
# (token 1 every time, where 1e-30 still gave the greedy tokens). Below 1e-5 a logit gap of
# 2e-4 already outweighs the Gumbel noise's whole range (about 20), so sampling there was
# greedy anyway but for near-ties.
GREEDY_BELOW = 1e-5


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32     # products wrap in int64; the low 32 bits stay exact
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, step: torch.Tensor, rows: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 in (0, 1), a pure function of (seed, step, row, column)."""
    row = torch.arange(rows, device=seed.device, dtype=torch.int64).unsqueeze(1)
    return _uniform(seed, step, row, vocab)


def uniform_per_row(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab]: row r draws what ``uniform(seed[r], step[r], 1, vocab)`` draws, so a request
    sampled in any slot of a shared batch gets the tokens it would get generated alone."""
    row = torch.zeros((seed.shape[0], 1), device=seed.device, dtype=torch.int64)
    return _uniform(seed.unsqueeze(1), step.unsqueeze(1), row, vocab)


def _uniform(seed, step, row, vocab: int) -> torch.Tensor:
    h = _mix32((seed + step * 0x9E3779B9) & _MASK32)
    col = torch.arange(vocab, device=seed.device, dtype=torch.int64).unsqueeze(0)
    h = _mix32((h ^ (row * 0x27D4EB2F)) & _MASK32)
    h = _mix32((h ^ (col * 0x165667B1)) & _MASK32)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)


def gumbel(seed, step, rows: int, vocab: int) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(seed, step, rows, vocab)))


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: int | None,
                  top_p: torch.Tensor | None) -> torch.Tensor:
    """transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in order
    (a temperature below ``GREEDY_BELOW`` divides as ``GREEDY_BELOW``: finite scores; the caller
    takes the argmax for those rows)."""
    scores = logits.float() / temperature.clamp(min=GREEDY_BELOW)
    if top_k is not None:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None:
        ordered, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[:, -1] = False          # keep at least the most likely token
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return scores


def next_tokens(logits: torch.Tensor, sampler: "Sampler", step: torch.Tensor) -> torch.Tensor:
    """[batch, vocab] logits -> [batch] int64 token ids."""
    if not sampler.do_sample:
        return torch.argmax(logits, dim=-1)
    scores = filter_logits(logits, sampler.temperature, sampler.top_k, sampler.top_p)
    rows, vocab = scores.shape
    sampled = torch.argmax(scores + gumbel(sampler.seed, step, rows, vocab), dim=-1)
    return torch.where(sampler.temperature < GREEDY_BELOW, torch.argmax(logits, dim=-1), sampled)


@dataclass
class Sampler:
    """A request's sampling settings. Whether to sample, ``top_k`` and which processors run are
    compiled into the programs; temperature, top-p, the seed, the minimum length and the
    repetition penalty are device tensors, so their values change nothing compiled (None where
    unused)."""

    do_sample: bool
    top_k: int | None
    temperature: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    seed: torch.Tensor | None = None
    min_new_tokens: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
