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

from .sampling import uniform_per_row

TOP_LOGPROBS = 5      # alternatives computed per token (a compiled size; OpenAI allows up to 20)


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
    scores = logits.float()
    rep = s.repetition.unsqueeze(1)
    penalised = torch.where(scores < 0, scores * rep, scores / rep)
    scores = torch.where(seen, penalised, scores)
    scores = scores - s.frequency.unsqueeze(1) * counts.float()
    scores = scores - s.presence.unsqueeze(1) * (counts > 0).float()
    stops = torch.zeros_like(seen).scatter(1, s.stop_ids.clamp(min=0), s.stop_ids >= 0)
    early = (generated < s.min_tokens).unsqueeze(1)
    return scores.masked_fill(stops & early, float("-inf"))


def warp(scores: torch.Tensor, s: RowSettings) -> torch.Tensor:
    """transformers' temperature, top-k and top-p warpers, row by row."""
    scores = scores / s.temperature.unsqueeze(1)
    vocab = scores.shape[-1]
    ordered = torch.sort(scores, dim=-1, descending=True).values
    k = s.top_k.clamp(min=1, max=vocab).unsqueeze(1)
    kth = ordered.gather(1, k - 1)
    kth = torch.where(s.top_k.unsqueeze(1) > 0, kth, torch.full_like(kth, float("-inf")))
    scores = scores.masked_fill(scores < kth, float("-inf"))
    # top-p exactly as transformers' TopPLogitsWarper: ascending order, drop the tokens whose
    # cumulative probability is at most 1 - top_p, always keep the most likely.
    ordered, order = torch.sort(scores, dim=-1, descending=False)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    top_p = s.top_p.unsqueeze(1)
    remove = (cumulative <= (1 - top_p)) & (top_p < 1.0)
    remove[:, -1] = False
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def choose(logits: torch.Tensor, s: RowSettings, seen, counts, generated) -> torch.Tensor:
    """[rows] next token ids."""
    scores = process(logits, s, seen, counts, generated)
    greedy = torch.argmax(scores, dim=-1)
    noise = -torch.log(-torch.log(uniform_per_row(s.seed, generated, scores.shape[-1])))
    sampled = torch.argmax(warp(scores, s) + noise, dim=-1)
    return torch.where(s.greedy, greedy, sampled)


def logprobs(logits: torch.Tensor, token: torch.Tensor):
    """(the chosen token's log-probability [rows], the TOP_LOGPROBS most likely tokens' ids and
    log-probabilities [rows, TOP_LOGPROBS]) under the model's own distribution (before any
    penalty or warper, as vLLM reports them by default)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, min(TOP_LOGPROBS, logp.shape[-1]), dim=-1)
    return logp.gather(1, token.unsqueeze(1)).squeeze(1), top.indices, top.values
