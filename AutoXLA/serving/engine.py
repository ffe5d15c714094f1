"""The device side of continuous batching: a fixed number of slots (rows) over one static KV cache,
each holding an unrelated request, and three programs compiled once, whatever the traffic.

Layout. Every row shares one write position ``t`` (the cache's fill level): each decode step
writes slot ``t`` of every row and advances it, as ``model.generate``'s decode does. A request
joins at a step boundary: ``admit`` runs its prompt alone (batch 1, its prompt bucket), writes the
keys and values into its row at slots ``[t - bucket, t)`` and picks its first token, so its row
then looks exactly like ``model.generate``'s cache for that prompt (the left-padded prompt bucket,
then one slot per token), shifted by an offset its attention mask hides. Its positions count from
its own prompt. When ``t`` nears the end of the cache, ``rebase`` moves every row's slots left
by what no live request uses (one copy of the cache, rare) and ``t`` with them: slot distances,
which the causal and sliding-window masks read, are unchanged.

Programs: one ``admit`` per prompt bucket, eight ``step``s (with or without sampling,
penalties, log-probabilities: what the live rows need), one ``rebase``; the request's values
(row, settings, shift) are small device vectors, so no value compiles anything. Every program is
traced once (the runtime's ``TracedPrograms``), as ``generation/steps.py`` traces generate's steps.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..generation import rows as row_sampling
from ..generation import validate
from ..generation.cache import allocate, pin
from ..generation.engine import engine_of
from ..generation.loop import activation_dtype, logits_kwargs, pad_prompt, scanned_stack
from ..generation.stacked_cache import StackedStaticCache
from ..generation.steps import cache_state, forward_logits, replicated, set_cache_state
from ..saving import unwrap
from ..state import state_of

STOP_WIDTH = 8     # stop token ids per request the device knows (for min_tokens); more are refused


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings, validated by the caller (serving/server.py)."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()     # EOS ids and the request's stop ids

    @property
    def samples(self) -> bool:
        return not self.greedy

    @property
    def penalises(self) -> bool:
        """A penalty or a minimum length: the step must process the logits."""
        return (self.min_tokens > 0 or self.repetition_penalty != 1.0
                or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    def tensors(self, device) -> list[torch.Tensor]:
        """The RowSettings of one row: [1] vectors (a 0-d tensor would be a graph constant)."""
        stops = list(self.stop_token_ids)[:STOP_WIDTH]
        stops += [-1] * (STOP_WIDTH - len(stops))
        f32, i64 = torch.float32, torch.int64
        values = [([self.greedy], torch.bool), ([1.0 if self.greedy else self.temperature], f32),
                  ([self.top_k], i64), ([self.top_p], f32), ([self.seed], i64),
                  ([self.min_tokens], i64), ([self.repetition_penalty], f32),
                  ([self.presence_penalty], f32), ([self.frequency_penalty], f32),
                  ([stops], i64)]
        return [torch.tensor(v, dtype=d).to(device) for v, d in values]


@dataclass
class Picked:
    """What a program chose, on the host: token ids and their log-probabilities per row, and the
    ``TOP_LOGPROBS`` most likely alternatives."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class SlotEngine:
    """``slots`` rows of ``cache_length`` KV slots for ``model``; prompts up to the largest of
    ``prompt_buckets``. Not thread-safe: one thread (the scheduler's) drives it."""

    def __init__(self, model, slots: int, cache_length: int, prompt_buckets: tuple[int, ...]):
        if slots < 1:
            raise ValueError(f"a server needs at least 1 slot, got {slots}")
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        self.max_prompt = self.prompt_buckets[-1]
        if cache_length < self.max_prompt + 2:
            raise ValueError(f"cache length {cache_length} leaves no room to generate after a "
                             f"prompt of {self.max_prompt}: raise the cache length")
        self.model, self.slots, self.length = model, slots, cache_length
        hf = unwrap(model)
        self.vocab = int(hf.config.get_text_config().vocab_size)
        state = state_of(model)
        self.mesh = state.mesh
        self.kv = state.plan.kv_cache(slots, cache_length, dtype=activation_dtype(hf))
        self.engine = engine = engine_of(model)
        validate.check_memory(self.kv, state.plan.mesh, engine.free_device_memory())
        self.device = dev = engine.device()
        self.cache = allocate(self.kv, self.mesh, dev, engine,
                              stacked=engine.stacks_layers and scanned_stack(model))
        self.keep = logits_kwargs(model)
        b, i64 = slots, torch.int64
        default = Sampling().tensors("cpu")
        settings = [t.expand(b, *t.shape[1:]).contiguous() for t in default]
        host = [torch.zeros((b, cache_length), dtype=i64),      # mask
                torch.zeros(b, dtype=i64),                      # pos: the next position per row
                torch.zeros(b, dtype=i64),                      # token: the last one per row
                torch.zeros(b, dtype=i64),                      # generated: new tokens per row
                torch.zeros((b, self.vocab), dtype=torch.bool),  # seen: prompt and output
                torch.zeros((b, self.vocab), dtype=torch.int32),  # counts: output only
                *settings]
        self.state = [replicated(t.to(dev), self.mesh, engine) for t in host]
        self._weights = [*model.parameters(), *model.buffers()]
        self._programs = {kind: engine.TracedPrograms("serve_" + kind)
                          for kind in ("admit", "step", "rebase")}
        self.traced = "once"
        self.t = 0                       # the shared write position, as the host knows it
        self.rebase(-self.max_prompt)    # room for the largest prompt before the first slot

    # -- the three programs ----------------------------------------------------------------
    def admit(self, row: int, ids: torch.Tensor, sampling: Sampling) -> Picked:
        """Run one prompt (``ids``: [length] int64 on the host) into ``row``; its first token."""
        length = ids.shape[0]
        bucket = next((p for p in self.prompt_buckets if p >= length), None)
        if bucket is None or bucket > self.t:
            raise ValueError(f"a prompt of {length} tokens does not fit (largest prompt bucket "
                             f"{self.max_prompt}, write position {self.t})")
        prompt = pad_prompt(ids.unsqueeze(0), torch.ones_like(ids).unsqueeze(0), 1, bucket,
                            bucket, 0)
        args = [t.to(self.device) for t in (prompt.ids, prompt.mask, prompt.positions,
                                            torch.tensor([row], dtype=torch.int64))]
        args += sampling.tensors(self.device)
        return self._call("admit", self._admit_body, args, row_out=True)

    def step(self, sample: bool = True, penalise: bool = True, logprobs: bool = True) -> Picked:
        """One token for every row (the free rows' are ignored); ``t`` advances by one.

        What the live rows need, each a program of its own, so that a step leaves out the work
        none of them asked for: ``sample``, some row samples; ``penalise``, some row has a
        penalty or a minimum length (only then are the rows' token histories kept: a row's are
        reset when it is admitted); ``logprobs``, some row wants log-probabilities (else they
        come back as zeros)."""
        if self.t >= self.length:
            raise RuntimeError("the write position reached the end of the cache: rebase first")
        body = functools.partial(self._step_body, sample, penalise, logprobs)
        picked = self._call("step", body, [], row_out=False, key=(sample, penalise, logprobs))
        self.t += 1
        return picked

    def rebase(self, shift: int) -> None:
        """Move every row's slots ``shift`` to the left (right if negative), and ``t`` with them;
        the slots that wrap around must hold nothing live (the scheduler's rule)."""
        args = [torch.tensor([shift], dtype=torch.int64).to(self.device)]
        self._call("rebase", self._rebase_body, args, row_out=None)
        self.t -= shift

    # -- the bodies: functions of device tensors ---------------------------------------------
    def _admit_body(self, ids, pmask, positions, row, *rest):
        n = len(row_sampling.RowSettings.__dataclass_fields__)
        one = row_sampling.RowSettings.from_tensors(rest[:n])
        mask, pos, token, generated, seen, counts, *settings = rest[n:]
        from transformers.cache_utils import DynamicCache

        prompt_cache = DynamicCache()
        logits = forward_logits(self.model, ids, pmask, positions, prompt_cache, self.keep)
        fill = self._fill()
        bucket = ids.shape[1]
        slots = torch.arange(bucket, device=ids.device) + (fill - bucket)
        self._write_row(prompt_cache, row, slots)
        row_mask = torch.zeros((1, self.length), dtype=mask.dtype, device=ids.device)
        row_mask = row_mask.index_copy(1, slots, pmask)
        seen_row = torch.zeros((1, self.vocab), dtype=torch.float32, device=ids.device)
        seen_row = seen_row.index_add(1, ids[0], pmask.float()) > 0
        counts_row = torch.zeros((1, self.vocab), dtype=counts.dtype, device=ids.device)
        zero = torch.zeros(1, dtype=torch.int64, device=ids.device)
        first = row_sampling.choose(logits, one, seen_row, counts_row, zero)
        lp = row_sampling.logprobs(logits, first)
        seen_row, counts_row = _count(seen_row, counts_row, first)
        new = [mask.index_copy(0, row, row_mask),
               pos.index_copy(0, row, pmask.sum(1)),
               token.index_copy(0, row, first),
               generated.index_copy(0, row, zero + 1),
               seen.index_copy(0, row, seen_row),
               counts.index_copy(0, row, counts_row)]
        new += [table.index_copy(0, row, value) for table, value in zip(settings, one.tensors())]
        return [first, *lp], new

    def _step_body(self, sample, penalise, want_logprobs, mask, pos, token, generated, seen,
                   counts, *settings):
        s = row_sampling.RowSettings.from_tensors(settings)
        fill = self._fill()
        ones = torch.ones((self.slots, 1), dtype=mask.dtype, device=mask.device)
        mask = mask.index_copy(1, fill.reshape(1), ones)
        logits = forward_logits(self.model, token.unsqueeze(1), mask, pos.unsqueeze(1), self.cache,
                          self.keep)
        chosen = row_sampling.choose(logits, s, seen, counts, generated, sample, penalise)
        lp = (row_sampling.logprobs(logits, chosen) if want_logprobs
              else row_sampling.no_logprobs(logits, chosen))
        if penalise:
            seen, counts = _count(seen, counts, chosen)
        return [chosen, *lp], [mask, pos + 1, chosen, generated + 1, seen, counts, *settings]

    def _rebase_body(self, shift, mask, *rest):
        index = (torch.arange(self.length, device=mask.device) + shift) % self.length
        moved = []
        for t in cache_state(self.cache):
            if t.dim() == 0:                              # a fill level
                moved.append(t - shift[0])
            else:                                         # keys or values: slots on dim -2
                moved.append(t.index_select(t.dim() - 2, index))
        set_cache_state(self.cache, moved)
        return [], [mask.index_select(1, index), *rest]

    # -- plumbing ------------------------------------------------------------------------------
    def _fill(self) -> torch.Tensor:
        return cache_state(self.cache)[2]

    def _write_row(self, prompt_cache, row, slots) -> None:
        """The prompt's keys and values (batch 1) into ``row`` at ``slots`` of every layer."""
        state = cache_state(self.cache)
        if isinstance(self.cache, StackedStaticCache):
            layers = [(torch.stack([l.keys for l in prompt_cache.layers]),
                       torch.stack([l.values for l in prompt_cache.layers]))]
            row_dim = 1
        else:
            layers = [(l.keys, l.values) for l in prompt_cache.layers]
            row_dim = 0
        out = list(state)
        for i, (k, v) in enumerate(layers):
            for j, new in ((3 * i, k), (3 * i + 1, v)):
                full = out[j]
                block = full.index_select(row_dim, row).index_copy(full.dim() - 2, slots, new)
                out[j] = full.index_copy(row_dim, row, block)
        set_cache_state(self.cache, out)

    @torch.no_grad()   # as generate: no autograd graph, and the scanned stack runs as a loop
    def _call(self, kind: str, body, args: list, row_out, key=None):
        """Run ``body(*args, *state)`` traced once; the new state kept, the picks read back."""
        n_args = len(args)

        def fn(tensors):
            real = cache_state(self.cache)
            set_cache_state(self.cache, tensors[n_args + len(self.state):])
            try:
                picks, new = body(*tensors[:n_args], *tensors[n_args:n_args + len(self.state)])
                pin(self.cache, self.kv, self.mesh, self.engine)
                new = [replicated(t, self.mesh, self.engine) for t in new]
                picks = [replicated(t, self.mesh, self.engine) for t in picks]
                return [*picks, *new, *cache_state(self.cache)]
            finally:
                set_cache_state(self.cache, real)

        inputs = [*args, *self.state, *cache_state(self.cache)]
        try:
            program = self._programs[kind].get(key, fn, inputs, self._weights)
            outputs = program(inputs, self._weights)
        except self.engine.NotTraceable as e:      # traced every call instead (slower, same result)
            self.traced = f"every step ({e})"
            outputs = fn(inputs)
        n_picks = 0 if row_out is None else 4
        picks, rest = outputs[:n_picks], outputs[n_picks:]
        self.state = rest[:len(self.state)]
        set_cache_state(self.cache, rest[len(self.state):])
        self.engine.sync()
        self.engine.finish_step()
        if row_out is None:
            return None
        token, logprob, top_ids, top_lp = (t.cpu() for t in picks)
        return Picked(token.tolist(), logprob.tolist(), top_ids.tolist(), top_lp.tolist())


def _count(seen, counts, token):
    """Record ``token`` ([rows]) in the rows' seen flags and output counts."""
    at = token.unsqueeze(1)
    seen = seen.scatter(1, at, torch.ones_like(at, dtype=torch.bool))
    counts = counts.scatter_add(1, at, torch.ones_like(at, dtype=counts.dtype))
    return seen, counts
