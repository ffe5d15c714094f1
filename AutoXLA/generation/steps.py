"""The prefill and the decode step as functions of device tensors, each traced once.

Running a step means running the model's Python forward, which torch_xla traces into a graph
every time: 15 to 24 ms of host work per token on a tiny model, ten times its device time
(docs/generation.md, "Host time per token"). Here a step is a function of its device tensors
only (the request's settings, the loop's state, the KV cache, the model's weights), so
the runtime's ``TracedPrograms`` (generation/engine.py) traces it on its first call into one XLA computation per input
signature, and every later call adds that computation to the graph without running the model's
Python. The programs live with the model (one set per model), so a second ``generate`` call with
the same buckets traces nothing.

A model whose forward reads a device value while traced (a data-dependent branch, which would be
frozen into the program) is refused by the trace; its steps then run traced every time, as
before, and ``Stats.traced`` says why.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from ..saving import unwrap
from . import rows
from .cache import grows, pin, write_prompt
from .sampling import Sampler, next_tokens
from .stacked_cache import StackedStaticCache

logger = logging.getLogger("AutoXLA")

# Per model: {"prefill" | "decode": TracedPrograms, and why a kind is traced every time}.
_PROGRAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass
class Carry:
    """What one step hands to the next, on the device: the token each row picked, the tokens so
    far ([batch, cache length]), which rows finished, the step counter, and with a repetition
    penalty which tokens each row has seen ([batch, vocab] bool: prompt and output)."""

    token: torch.Tensor
    tokens: torch.Tensor
    finished: torch.Tensor
    step: torch.Tensor
    seen: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.token, self.tokens, self.finished, self.step,
                *(() if self.seen is None else (self.seen,))]


class Steps:
    """One generate call's prefill and decode steps, bound to its model, request and cache."""

    def __init__(self, model, request, cache, kv, mesh, keep: dict, device, engine,
                 once: bool = True):
        self.model, self.cache, self.kv, self.mesh, self.keep = model, cache, kv, mesh, keep
        self.engine = engine      # the runtime's programs and layouts (generation/engine.py)
        self.do_sample = request.do_sample
        self.top_k = request.top_k if request.do_sample else None
        self.top_p = request.do_sample and request.top_p < 1.0
        self.min_new = request.min_new_tokens > 0 and bool(request.eos_token_ids)
        self.penalise = request.repetition_penalty != 1.0
        self.n_carry = 5 if self.penalise else 4
        # The request's values are inputs, so another seed, pad id or temperature compiles
        # nothing: [pad, seed, min new tokens, eos...] and [temperature, top-p, repetition
        # penalty], as vectors (torch_xla makes a 0-d tensor holding 0 or 1 a constant of the
        # graph: another program).
        self.request = [
            torch.tensor([request.fill_token_id, request.seed, request.min_new_tokens,
                          *(request.eos_token_ids or (-1,))], dtype=torch.int64, device=device),
            torch.tensor([request.temperature, request.top_p, request.repetition_penalty],
                         dtype=torch.float32, device=device)]
        hf = unwrap(model)
        self._programs = _PROGRAMS.setdefault(hf, {})
        self._weights = [*model.parameters(), *model.buffers()]
        self._bound: dict = {}
        self._once = once
        # What the programs depend on besides their inputs' shapes: the settings compiled in,
        # and the cache's shapes (the prefill makes the cache, which is not one of its inputs):
        # those of the plan's KV cache, of which the cache is the whole or a rank's piece.
        self._key = (request.sampling_key, hf.training,
                     getattr(hf.config, "_attn_implementation", None),
                     kv.shape, kv.value_shape, kv.dtype, isinstance(cache, StackedStaticCache))

    @property
    def traced(self) -> str:
        """"once", or why a step runs traced every time."""
        if not self.engine.traces_steps:
            return "never (this runtime runs each step as it is)"
        if not self._once:
            return "every step (trace_steps_once=False)"
        refused = [f"{k}: {self._programs[k + ' refused']}" for k in ("prefill", "decode")
                   if k + " refused" in self._programs]
        return "every step (" + "; ".join(refused) + ")" if refused else "once"

    def prefill(self, finished, ids, mask, positions, columns) -> tuple[Carry, torch.Tensor]:
        """The prompt's forward, its keys and values into an empty cache, the first token.
        ``columns``: 1 where ``ids`` holds the caller's input ids (not bucket padding): the
        tokens a repetition penalty counts, as transformers counts its input_ids.

        The empty cache and the loop's first state are made inside the program: as inputs they
        would be one more program to compile (zeros) per call's first buckets."""
        def body(sampler, eos, pad, finished, ids, mask, positions, *columns):
            from transformers.cache_utils import DynamicCache

            dynamic = grows(self.cache)       # new and empty (cache.py)
            if not dynamic:
                set_cache_state(self.cache, [torch.zeros_like(t) for t in cache_state(self.cache)])
            batch, length = finished.shape[0], self.kv.length
            carry = Carry(torch.zeros(batch, dtype=torch.int64, device=ids.device),
                          pad.expand(batch, length).clone(), finished,
                          torch.zeros((), dtype=torch.int64, device=ids.device))
            # no config: full layers, the sliding ones too
            prompt_cache = self.cache if dynamic else DynamicCache()
            logits = forward_logits(self.model, ids, mask, positions, prompt_cache, self.keep)
            if not dynamic:
                write_prompt(self.cache, prompt_cache, ids.shape[1], ids.device)
            if columns:
                counted = torch.zeros(logits.shape, dtype=torch.float32, device=ids.device)
                carry.seen = counted.scatter_add(1, ids, columns[0].float()) > 0
            return self._advance(logits, sampler, carry, eos, pad)

        args = [finished, ids, mask, positions, *((columns,) if self.penalise else ())]
        return self._run("prefill", body, args, cache_in=False)

    def decode(self, carry: Carry, mask, lengths) -> tuple[Carry, torch.Tensor]:
        """One token per row through the model at its position; the next token."""
        def body(sampler, eos, pad, token, tokens, finished, step, *rest):
            *seen, mask, lengths = rest
            carry = Carry(token, tokens, finished, step, *seen)
            positions = (lengths + step - 1).unsqueeze(1)
            logits = forward_logits(self.model, token.unsqueeze(1), mask, positions,
                                    self.cache, self.keep)
            return self._advance(logits, sampler, carry, eos, pad)

        return self._run("decode", body, [*carry.tensors(), mask, lengths], cache_in=True)

    # -- one step as a function of a flat list of tensors ---------------------------------
    def _run(self, kind: str, body, args: list, cache_in: bool):
        inputs = [*self.request, *args, *(cache_state(self.cache) if cache_in else ())]
        fn = None
        program = self._bound.get(kind)
        if program is None and self._once and kind + " refused" not in self._programs:
            programs = self._programs.setdefault(kind, self.engine.TracedPrograms(kind))
            fn = self._flat(body, len(args), cache_in)
            try:
                program = programs.get(self._key, fn, inputs, self._weights)
            except self.engine.NotTraceable as e:
                self._programs[kind + " refused"] = str(e)
                logger.info("generation: the %s step runs traced every time: %s", kind, e)
            # Every later step of this call has the same signature: no lookup per token.
            self._bound[kind] = program
        if program is not None:
            outputs = program(inputs, self._weights)
        else:
            outputs = (fn or self._flat(body, len(args), cache_in))(inputs)
        n = self.n_carry
        set_cache_state(self.cache, outputs[n + 1:])
        return Carry(*outputs[:n]), outputs[n]

    def _flat(self, body, n_args: int, cache_in: bool):
        """``body`` as a function of one flat list (request, arguments, cache state if
        ``cache_in``) returning one flat list (carry, done, cache state)."""
        n_request = len(self.request)

        def fn(tensors):
            request, args = tensors[:n_request], tensors[n_request:n_request + n_args]
            real = cache_state(self.cache)
            if cache_in:
                set_cache_state(self.cache, tensors[n_request + n_args:])
            try:
                ints, floats = request
                new, done = body(self._sampler(ints, floats), ints[3:], ints[0], *args)
                return [*new.tensors(), done, *cache_state(self.cache)]
            finally:
                set_cache_state(self.cache, real)   # the cache keeps no traced tensor
        return fn

    def _sampler(self, ints, floats) -> Sampler:
        return Sampler(self.do_sample, self.top_k, floats[0], floats[1] if self.top_p else None,
                       ints[1], ints[2] if self.min_new else None,
                       floats[2] if self.penalise else None)

    def _advance(self, logits, sampler, carry: Carry, eos, pad):
        """Pick each row's next token (pad once a row finished), record it, update the flags;
        the cache re-annotated with its plan."""
        pin(self.cache, self.kv, self.mesh, self.engine)
        # transformers' logits processors, before its warpers (next_tokens applies those)
        if sampler.repetition_penalty is not None:
            logits = rows.repetition_penalty(logits.float(), carry.seen,
                                             sampler.repetition_penalty)
        if sampler.min_new_tokens is not None:
            batch = logits.shape[0]
            logits = rows.suppress(logits.float(), eos.unsqueeze(0).expand(batch, -1),
                                   (carry.step < sampler.min_new_tokens).expand(batch))
        token = next_tokens(logits, sampler, carry.step)
        token = torch.where(carry.finished, pad.expand_as(token), token)
        tokens = carry.tokens.index_copy(1, carry.step.reshape(1), token.unsqueeze(1))
        # The state carried to the next step, replicated (it is a few integers per row): reading
        # the tokens back is then a plain copy (a batch-sharded result needs a gathering program
        # per cache length), and every step gets its inputs sharded alike.
        tokens, token = (replicated(t, self.mesh, self.engine) for t in (tokens, token))
        finished = replicated(carry.finished | (token.unsqueeze(1) == eos.unsqueeze(0)).any(1),
                              self.mesh, self.engine)
        seen = carry.seen
        if seen is not None:
            seen = seen.scatter(1, token.unsqueeze(1), torch.ones_like(token.unsqueeze(1),
                                                                      dtype=torch.bool))
        return Carry(token, tokens, finished, carry.step + 1, seen), finished.all()


def replicated(t: torch.Tensor, mesh, engine) -> torch.Tensor:
    return engine.mark_sharding(t, mesh, (None,) * t.dim())


def forward_logits(model, ids, mask, positions, cache, keep: dict) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, **keep)
    return out.logits[:, -1, :]


def cache_state(cache) -> list[torch.Tensor]:
    """The cache's device tensors: keys, values and fill level, per layer or stacked; keys and
    values per layer for a growing cache (its fill level is their length)."""
    if isinstance(cache, StackedStaticCache):
        return [cache.keys, cache.values, cache.cumulative_length]
    if grows(cache):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t for layer in cache.layers
            for t in (layer.keys, layer.values, layer.cumulative_length)]


def set_cache_state(cache, tensors: list[torch.Tensor]) -> None:
    if isinstance(cache, StackedStaticCache):
        cache.keys, cache.values, fill = tensors
        cache.cumulative_length = fill
        for layer in cache.layers:       # the layer views read the fill level too
            layer.cumulative_length = fill
        return
    if grows(cache):      # zip: before the prefill it has no layers, and no tensors to set
        for layer, keys, values in zip(cache.layers, tensors[0::2], tensors[1::2]):
            layer.keys, layer.values = keys, values
        return
    for i, layer in enumerate(cache.layers):
        layer.keys, layer.values, layer.cumulative_length = tensors[3 * i:3 * i + 3]
