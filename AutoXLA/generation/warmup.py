"""Compile ahead of time the programs a server will need: one prefill and one decode program per
(batch bucket, prompt bucket) for a given number of new tokens, before the first request."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .engine import engine_of
from .buckets import GenerationOptions


@dataclass(frozen=True)
class WarmupReport:
    shapes: tuple[tuple[int, int, int], ...]   # (batch bucket, prompt bucket, cache length)
    programs_compiled: int
    seconds: float

    def __str__(self) -> str:
        return (f"warm-up: {len(self.shapes)} bucket pair(s), {self.programs_compiled} program(s) "
                f"compiled in {self.seconds:.1f} s")


def warm_up(model, batch_sizes=(1,), prompt_lengths=(16,), max_new_tokens: int = 256,
            verbose: bool = True, **generate_kwargs) -> WarmupReport:
    """Run a two-step generate for every (batch, prompt length) bucket pair these sizes fall in,
    with the sampling settings of ``generate_kwargs`` (greedy by default): each compiles its
    prefill and decode programs, which every later request in those buckets reuses."""
    from tqdm.auto import tqdm

    options = GenerationOptions.from_any(model.autoxla_generation)
    shapes = sorted({(options.batch_bucket(b), options.prompt_bucket(p)) for b in batch_sizes
                     for p in prompt_lengths})
    generate_kwargs.setdefault("do_sample", False)
    generate_kwargs.setdefault("eos_token_id", None)     # run both steps whatever comes out
    engine = engine_of(model)
    before, t0, done = engine.compile_count(), time.perf_counter(), []
    with engine.device_owner():     # the whole warm-up before any request thread's generate
        for batch, length in tqdm(shapes, desc="AutoXLA: warm-up", unit="bucket",
                                  disable=not verbose):
            ids = torch.full((batch, length), 1, dtype=torch.int64)
            model.generate(input_ids=ids, max_new_tokens=max_new_tokens, _stop_after=2,
                           **generate_kwargs)
            done.append((batch, length, options.cache_length(length, max_new_tokens)))
    return WarmupReport(tuple(done), engine.compile_count() - before, time.perf_counter() - t0)
