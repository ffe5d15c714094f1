"""``model.generate`` with fixed shapes: one prefill program per (batch, prompt, cache) bucket and
one decode program per (batch, cache) bucket, reused for every token.

Per call: the prompt is padded up to its buckets on the host, the static KV cache is allocated at
the cache bucket, one prefill step runs the prompt (as an ordinary forward), copies its keys and
values into the cache and picks the first token, then each decode step feeds one token per row.
Everything a step changes (the cache, its fill level, the step counter, the tokens so far, which
rows finished) lives on the device, so every decode step is the same program; the steps are traced
once, not per token (steps.py). The host looks at the device only every ``stop_check_every`` steps
(has every row finished?) and once at the end (the tokens).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

from ..saving import unwrap
from ..state import record_state, state_of
from . import validate
from .buckets import GenerationOptions
from .cache import allocate
from .engine import engine_of
from .request import build_request
from .steps import Steps, replicated


@dataclass
class Prompt:
    """A batch padded up to its buckets, on the host."""

    ids: torch.Tensor         # [Bb, Pb] int64: left-padded with pad columns, extra rows copy row 0
    mask: torch.Tensor        # [Bb, L] int64: the prompt's mask, then 1 for every slot to come
    positions: torch.Tensor   # [Bb, Pb] int64: as transformers counts them (cumsum of the mask)
    lengths: torch.Tensor     # [Bb] int64: real tokens per row (the next token's position)
    finished: torch.Tensor    # [Bb] bool: True for the rows added to fill the batch bucket
    columns: torch.Tensor     # [Bb, Pb] int64: 1 on the caller's columns, 0 on bucket padding


@dataclass
class Stats:
    """What the last generate call did, for the CLI's summary and the benchmarks."""

    batch_bucket: int = 0
    prompt_bucket: int = 0
    cache_length: int = 0
    new_tokens: int = 0          # generated per row (steps run, before trimming finished rows)
    prefill_seconds: float = 0.0     # wall time, compilation included
    decode_seconds: float = 0.0
    prefill_compile_seconds: float = 0.0
    decode_compile_seconds: float = 0.0
    # CPU time this thread spent issuing the decode steps (tracing, if any, and dispatch;
    # compilation excluded); the rest of decode_seconds is waiting on the device and compiling.
    decode_host_seconds: float = 0.0
    traced: str = ""             # "once", or why the steps were traced every time
    # dtensor runtime: the weights gathered once for the call (else at every step: too big)
    kept_gathered: bool = False

    @property
    def host_ms_per_token(self) -> float:
        return 1000 * self.decode_host_seconds / max(self.steps, 1)

    @property
    def device_ms_per_token(self) -> float:
        """Decode wall time not spent by the host issuing steps nor compiling, per token."""
        busy = self.decode_seconds - self.decode_compile_seconds - self.decode_host_seconds
        return 1000 * max(busy, 0.0) / max(self.steps, 1)

    @property
    def steps(self) -> int:
        """Decode steps run: every new token but the prefill's."""
        return max(self.new_tokens - 1, 0)

    def throughput(self, prompt_tokens: int) -> tuple[float, float]:
        """(prefill, decode) tokens per second, compilation excluded."""
        prefill = self.prefill_seconds - self.prefill_compile_seconds
        decode = self.decode_seconds - self.decode_compile_seconds
        return prompt_tokens / max(prefill, 1e-9), self.steps / max(decode, 1e-9)


def pad_prompt(ids: torch.Tensor, mask: torch.Tensor, batch_bucket: int, prompt_bucket: int,
               cache_length: int, pad_token_id: int) -> Prompt:
    b, s = ids.shape
    pad_cols = prompt_bucket - s
    padded = torch.full((batch_bucket, prompt_bucket), pad_token_id, dtype=torch.int64)
    prompt_mask = torch.zeros((batch_bucket, prompt_bucket), dtype=torch.int64)
    padded[:b, pad_cols:] = ids
    prompt_mask[:b, pad_cols:] = mask
    padded[b:] = padded[0]               # filler rows: a real prompt, so no row is all padding
    prompt_mask[b:] = prompt_mask[0]
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0).masked_fill(prompt_mask == 0, 1)
    full_mask = torch.ones((batch_bucket, cache_length), dtype=torch.int64)
    full_mask[:, :prompt_bucket] = prompt_mask
    finished = torch.zeros(batch_bucket, dtype=torch.bool)
    finished[b:] = True
    columns = torch.zeros((batch_bucket, prompt_bucket), dtype=torch.int64)
    columns[:, pad_cols:] = 1
    return Prompt(padded, full_mask, positions, prompt_mask.sum(-1), finished, columns)


def default_attention_mask(ids: torch.Tensor, request) -> torch.Tensor:
    """transformers' rule: mask out pad tokens when the pad token is not also EOS."""
    pad = request.pad_token_id
    if pad is not None and pad not in request.eos_token_ids and bool((ids == pad).any()):
        return (ids != pad).long()
    return torch.ones_like(ids)


@torch.no_grad()   # as transformers' generate: no autograd graph across the steps
def generate(model, inputs=None, *, input_ids=None, attention_mask=None, generation_config=None,
             streamer=None, seed=None, tokenizer=None, _stop_after: int | None = None,
             **kwargs) -> torch.Tensor:
    """Greedy or sampled generation with transformers' keywords; returns prompt + new tokens
    (pad after a row's EOS or stop string) on the prompt's device, like transformers' generate;
    with ``num_return_sequences=n``, n rows per prompt, each prompt's rows together."""
    hf = unwrap(model)
    raw = input_ids if input_ids is not None else inputs
    ids = validate.check_ids(raw, validate.vocab_size(hf))
    out_device = raw.device
    request = build_request(hf, ids.shape[1], generation_config, seed=seed, tokenizer=tokenizer,
                            **kwargs)
    mask = validate.check_mask(attention_mask if attention_mask is not None
                               else default_attention_mask(ids, request), ids)
    if request.num_return_sequences > 1:      # as transformers: each prompt's rows together
        ids = ids.repeat_interleave(request.num_return_sequences, dim=0)
        mask = mask.repeat_interleave(request.num_return_sequences, dim=0)
    # Settable after loading as a dict too (docs/generation.md): checked here, every call.
    options = GenerationOptions.from_any(model.autoxla_generation)
    batch, length = ids.shape
    validate.check_length(hf.config, options, length, request.max_new_tokens)
    engine = engine_of(model)
    bb, pb, cache_length = options.shapes(batch, length, request.max_new_tokens,
                                          padded=engine.static_shapes)
    plan = state_of(model).plan
    kv = plan.kv_cache(bb, cache_length, dtype=activation_dtype(hf))
    validate.check_memory(kv, plan.mesh, engine.free_device_memory())
    prompt = pad_prompt(ids, mask, bb, pb, cache_length, request.fill_token_id)
    stats = Stats(bb, pb, cache_length)
    if streamer is not None:
        streamer.put(ids)                 # as transformers: the prompt first
    with engine.device_owner(), engine.generating():   # one generating thread at a time
        new = _run(model, engine, prompt, request, kv, options, streamer, stats, batch,
                   _stop_after or request.max_new_tokens, tokenizer)
        record_state(model, last_generate=stats)
    return torch.cat([ids, new], dim=1).to(out_device)


def activation_dtype(hf) -> torch.dtype:
    """The dtype the embedding lookup produces (an int8 QuantizedEmbedding outputs its float
    dtype), which the KV cache holds."""
    table = hf.get_input_embeddings()
    return getattr(table, "output_dtype", table.weight.dtype)


def _run(model, engine, prompt: Prompt, request, kv, options: GenerationOptions, streamer, stats: Stats,
         batch: int, steps: int, tokenizer=None) -> torch.Tensor:
    dev = engine.device()
    mesh = state_of(model).mesh
    cache = allocate(kv, mesh, dev, engine, stacked=engine.stacks_layers and scanned_stack(model))
    # Inputs from the host are replicated from the start: a tensor first used by the first
    # decode step would otherwise enter it unsharded and every later step replicated, two
    # different programs.
    mask, lengths, finished = (replicated(t.to(dev), mesh, engine)
                               for t in (prompt.mask, prompt.lengths, prompt.finished))
    run = Steps(model, request, cache, kv, mesh, logits_kwargs(model), dev, engine,
                options.trace_steps_once)
    check_every = options.stop_check_every
    ends = Ends(request.eos_token_ids, request.stop_strings, tokenizer, request.fill_token_id)
    watch = streamer is not None or ends.any   # else nothing to look at before the end

    t0, c0 = time.perf_counter(), engine.compile_seconds()
    length = prompt.ids.shape[1]
    carry, done = run.prefill(finished, prompt.ids.to(dev), prompt.mask[:, :length].to(dev),
                              prompt.positions.to(dev), prompt.columns.to(dev))
    engine.sync()
    engine.finish_step()
    streamed, stopped = (_check(done, carry.tokens, streamer, 0, 1, batch, ends) if watch
                         else (0, False))
    stats.prefill_seconds = time.perf_counter() - t0   # with a check, the prefill has run
    stats.prefill_compile_seconds = engine.compile_seconds() - c0
    steps_run = 1
    t0, c0, host = time.perf_counter(), engine.compile_seconds(), 0.0
    for t in range(1, min(steps, request.max_new_tokens)):
        if stopped:
            break
        if watch and t % check_every == 0:
            streamed, stopped = _check(done, carry.tokens, streamer, streamed, t, batch, ends)
            if stopped:
                break
        h0 = time.thread_time()      # this thread's CPU time: waiting on the device is not in it
        carry, done = run.decode(carry, mask, lengths)
        engine.sync()
        host += time.thread_time() - h0
        engine.finish_step()
        steps_run += 1
    tokens = carry.tokens.cpu()
    stats.decode_seconds = time.perf_counter() - t0
    stats.decode_compile_seconds = engine.compile_seconds() - c0
    # A first call compiles on this thread too: that time is counted as compiling, not host.
    stats.decode_host_seconds = max(host - stats.decode_compile_seconds, 0.0)
    stats.new_tokens = steps_run
    stats.traced = run.traced
    stats.kept_gathered = engine.kept_gathered
    new = ends.trim(tokens[:batch, :steps_run])
    if streamer is not None:
        if batch == 1:
            streamer.put(new[0, streamed:])
        streamer.end()
    return new


def _check(done, tokens, streamer, streamed: int, upto: int, batch: int, ends: "Ends"):
    """(tokens streamed so far, every row finished?): one small device-to-host copy (two with a
    streamer or stop strings, which read the tokens), the streamer given the new tokens up to
    and including the first EOS or stop string."""
    stopped = bool(done.cpu())
    streams = streamer is not None and batch == 1
    if not streams and not ends.stop_strings:
        return streamed, stopped
    new, ended = ends.cut(tokens.cpu()[:batch, :upto])
    stopped = stopped or ended
    if streams:
        streamer.put(new[0, streamed:])
        streamed = max(streamed, new.shape[1])
    return streamed, stopped


class Ends:
    """Where each row's output ends, as transformers ends it: at its first EOS token, or at the
    first token that completes one of the stop strings (which stays in the output, as with
    transformers' StopStringCriteria); the device knows the EOS, the host finds the strings."""

    def __init__(self, eos_ids, stop_strings, tokenizer, pad_id: int):
        self.eos_ids, self.stop_strings = tuple(eos_ids or ()), tuple(stop_strings or ())
        self.tokenizer, self.pad_id = tokenizer, pad_id

    @property
    def any(self) -> bool:
        return bool(self.eos_ids or self.stop_strings)

    def row_end(self, row: list[int]) -> int | None:
        """The index of the token that ends ``row``, or None."""
        eos = next((i for i, token in enumerate(row) if token in self.eos_ids), None)
        limit = len(row) if eos is None else eos + 1
        if not self.stop_strings or not self._has_stop(row[:limit]):
            return eos
        lo, hi = 0, limit - 1        # the first prefix holding a stop string, by bisection
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._has_stop(row[:mid + 1]) else (mid + 1, hi)
        return lo

    def _has_stop(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids)
        return any(s in text for s in self.stop_strings)

    def trim(self, new: torch.Tensor) -> torch.Tensor:
        return self.cut(new)[0]

    def cut(self, new: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(``new`` padded after each row's end, the device having done so after an EOS, and
        without the steps run after every row had ended, where transformers stops; whether
        every row has ended: known for stop strings only, else False, as the device says)."""
        if not self.any or new.numel() == 0:
            return new, False
        if not self.stop_strings:
            return _trim(new, self.eos_ids), False
        new = new.clone()
        ends = [self.row_end(row) for row in new.tolist()]
        for r, end in enumerate(ends):
            if end is not None:
                new[r, end + 1:] = self.pad_id
        ended = all(end is not None for end in ends)
        return (new[:, :max(ends) + 1] if ended else new), ended


def _trim(new: torch.Tensor, eos_ids) -> torch.Tensor:
    """Drop the steps run after every row had finished (transformers stops at that point)."""
    if not eos_ids or new.numel() == 0:
        return new
    hit = torch.isin(new, torch.tensor(eos_ids, dtype=new.dtype))
    if not bool(hit.any(1).all()):
        return new
    last = int(hit.int().argmax(1).max())     # the step at which the last row emitted EOS
    return new[:, :last + 1]


def logits_kwargs(model) -> dict:
    """Ask only for the last position's logits where the model supports it (prefill then runs
    the head on one position, not the whole prompt)."""
    params = inspect.signature(unwrap(model).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def scanned_stack(model) -> bool:
    stack = state_of(model).plan.stack
    return stack is not None and stack.scanned


