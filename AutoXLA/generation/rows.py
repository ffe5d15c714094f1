"""Choosing the next token when every row of the batch has settings of its own (a server's slots
hold unrelated requests): per-row temperature, top-k, top-p, seed, penalties and minimum length,
all device tensors, so any mix of requests runs the same compiled program.

The order is transformers' (``GenerationMixin._get_logits_processor``): the repetition penalty
on the raw logits, then the minimum length (EOS and stop tokens at -inf), then the warpers
(temperature, top-k, top-p) for the rows that sample. Presence and frequency penalties, which
transformers lacks, are OpenAI's definition (logit minus presence if the token was generated,
minus frequency times how often), applied after the repetition penalty as vLLM applies them.
A greedy row takes the argmax of its processed logits, a sampling row the Gumbel-max draw with
``sampling.uniform_per_row`` noise: the tokens a request gets alone from ``model.generate``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .sampling import GREEDY_BELOW, uniform_per_row

TOP_LOGPROBS = 5      # alternatives computed per token (a compiled size; OpenAI allows up to 20)
TOP_K_LIMIT = 1024    # the largest top_k a row may ask (a compiled size)


@dataclass
class RowSettings:
    """One entry per row, on the device; ``stop_ids`` is [rows, S], -1 where unused."""

    greedy: torch.Tensor        # bool
    temperature: torch.Tensor   # float32 (1.0 for greedy rows)
    top_k: torch.Tensor         # int64, 0: no top-k filter
    top_p: torch.Tensor         # float32, 1.0: no nucleus filter
    seed: torch.Tensor          # int64
    min_tokens: torch.Tensor    # int64: stop tokens suppressed before this many new tokens
    repetition: torch.Tensor    # float32, 1.0: none (transformers' repetition_penalty)
    presence: torch.Tensor      # float32, 0.0: none (OpenAI's presence_penalty)
    frequency: torch.Tensor     # float32, 0.0: none (OpenAI's frequency_penalty)
    stop_ids: torch.Tensor      # int64 [rows, S]

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_tensors(cls, tensors) -> "RowSettings":
        return cls(*tensors)


def process(logits: torch.Tensor, s: RowSettings, seen: torch.Tensor, counts: torch.Tensor,
            generated: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] float32 scores after the penalties and the minimum length.

    seen: [rows, vocab] bool, tokens of the prompt and the output (repetition penalty, as
    transformers counts the whole input); counts: [rows, vocab] int32, of the output only
    (presence and frequency, as OpenAI counts them); generated: [rows] new tokens so far."""
    scores = repetition_penalty(logits.float(), seen, s.repetition.unsqueeze(1))
    scores = scores - s.frequency.unsqueeze(1) * counts.float()
    scores = scores - s.presence.unsqueeze(1) * (counts > 0).float()
    return suppress(scores, s.stop_ids, generated < s.min_tokens)


def repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: a seen token's logit divided by the
    penalty if positive, multiplied if negative (``penalty`` a tensor that broadcasts)."""
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def suppress(scores: torch.Tensor, stop_ids: torch.Tensor, early: torch.Tensor) -> torch.Tensor:
    """transformers' MinNewTokensLengthLogitsProcessor: ``stop_ids`` ([rows, S], -1 unused) at
    -inf in the rows still ``early`` ([rows] bool: fewer new tokens than their minimum)."""
    stops = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter(
        1, stop_ids.clamp(min=0), stop_ids >= 0)
    return scores.masked_fill(stops & early.unsqueeze(1), float("-inf"))


def warp(scores: torch.Tensor, s: RowSettings) -> torch.Tensor:
    """transformers' temperature, top-k and top-p warpers, row by row.

    Without sorting the vocabulary: XLA:CPU sorts a [16, 49152] batch of logits in about 230
    ms, which was most of a decode step. Top-k reads each row's k-th largest score from one
    ``topk`` of ``TOP_K_LIMIT`` (exact; a larger k is refused where requests are checked);
    top-p finds each row's nucleus boundary by bisection over the probabilities (48 halvings
    of a masked sum: 25 ms for that batch), transformers' set up to the rounding of a sum."""
    scores = scores / s.temperature.clamp(min=GREEDY_BELOW).unsqueeze(1)
    largest = torch.topk(scores, min(TOP_K_LIMIT, scores.shape[-1]), dim=-1).values
    k = s.top_k.clamp(min=1, max=largest.shape[-1]).unsqueeze(1)
    kth = largest.gather(1, k - 1)
    scores = scores.masked_fill((scores < kth) & (s.top_k > 0).unsqueeze(1), float("-inf"))
    # top-p as transformers' TopPLogitsWarper: drop the least likely tokens while their total
    # probability stays at most 1 - top_p; the most likely token always stays.
    probs = scores.softmax(dim=-1)
    lo = torch.zeros_like(s.top_p)            # the mass of tokens at most lo is <= 1 - top_p
    hi = probs.max(-1).values                 # ... and above it at hi
    for _ in range(48):
        mid = (lo + hi) * 0.5
        ok = (probs * (probs <= mid.unsqueeze(1))).sum(-1) <= 1 - s.top_p
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    remove = (probs <= lo.unsqueeze(1)) & (s.top_p < 1.0).unsqueeze(1)
    top = torch.zeros_like(remove).scatter(1, scores.argmax(-1, keepdim=True), True)
    return scores.masked_fill(remove & ~top, float("-inf"))


def choose(logits: torch.Tensor, s: RowSettings, seen, counts, generated,
           sample: bool = True, penalise: bool = True) -> torch.Tensor:
    """[rows] next token ids. ``sample`` and ``penalise`` say whether any row samples, and
    whether any has a penalty or a minimum length: without, that work is left out of the
    program (a batch of greedy rows without penalties costs an argmax)."""
    scores = process(logits, s, seen, counts, generated) if penalise else logits.float()
    greedy = torch.argmax(scores, dim=-1)
    if not sample:
        return greedy
    noise = -torch.log(-torch.log(uniform_per_row(s.seed, generated, scores.shape[-1])))
    sampled = torch.argmax(warp(scores, s) + noise, dim=-1)
    # a temperature below GREEDY_BELOW is greedy (sampling.py); the server marks such rows
    # greedy already, this keeps any other caller's scores finite and its tokens greedy
    return torch.where(s.greedy | (s.temperature < GREEDY_BELOW), greedy, sampled)


def logprobs(logits: torch.Tensor, token: torch.Tensor):
    """(the chosen token's log-probability [rows], the TOP_LOGPROBS most likely tokens' ids and
    log-probabilities [rows, TOP_LOGPROBS]) under the model's own distribution (before any
    penalty or warper, as vLLM reports them by default)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, min(TOP_LOGPROBS, logp.shape[-1]), dim=-1)
    return logp.gather(1, token.unsqueeze(1)).squeeze(1), top.indices, top.values


def no_logprobs(logits: torch.Tensor, token: torch.Tensor):
    """``logprobs``' shapes, zeros: for a step no row asked log-probabilities of."""
    rows, k = token.shape[0], min(TOP_LOGPROBS, logits.shape[-1])
    zeros = torch.zeros(rows, dtype=torch.float32, device=token.device)
    return zeros, torch.zeros((rows, k), dtype=torch.int64, device=token.device), \
        torch.zeros((rows, k), dtype=torch.float32, device=token.device)
