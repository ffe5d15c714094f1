"""`autoxla generate PATH --prompt TEXT`: load sharded, stream the answer, then say what it cost.

The prompt goes through the checkpoint's chat template when it has one (--raw skips it). The
summary line counts what a user pays on an XLA device: load time, programs compiled and the time
spent compiling, prefill and decode throughput.
"""
from __future__ import annotations

import time

from .. import backend
from ..runtimes.dtensor import process
from ..state import state_of
from ..testing.real_model import chat_prompt
from .model_args import (add_model_arguments, add_runtime_arguments, load_model, runtime_of,
                         started_per_device)


def add_arguments(p) -> None:
    add_model_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--prompt", required=True, help="the text to answer")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)


def _prompt_ids(args, tokenizer):
    templated = not args.raw and bool(tokenizer.chat_template)
    text = chat_prompt(tokenizer, args.prompt) if templated else args.prompt
    # The template already holds the special tokens; a raw prompt gets the tokenizer's own.
    return tokenizer(text, return_tensors="pt", add_special_tokens=not templated)


def _sampling(args) -> dict:
    return {k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k),
                              ("top_p", args.top_p)) if v is not None}


def _run_dtensor(args, model, tokenizer, load_seconds) -> int:
    """The dtensor runtime: every rank generates (their collectives need them all), rank 0
    prints. transformers' generate over the sharded modules (docs/runtimes.md): no compiled
    programs to count, so the summary is load time and wall-clock tokens/s."""
    import torch
    from transformers import TextStreamer

    first = process.rank() == 0
    if first:
        print(f"plan: {state_of(model).plan.summary()}", flush=True)
    ids = _prompt_ids(args, tokenizer)
    if args.seed is not None:
        torch.manual_seed(args.seed)        # the same seed on every rank: the same samples
    sampling = _sampling(args)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if first else None
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                             max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                             streamer=streamer, **sampling)
    seconds = time.perf_counter() - t0
    new = out.shape[1] - ids["input_ids"].shape[1]
    if first:
        print(f"\nsummary: loaded in {load_seconds:.1f} s on {process.world_size()} process(es) "
              f"(dtensor runtime); {new} new tokens in {seconds:.2f} s ({new / seconds:.1f} "
              "tokens/s, prefill included)")
    return 0


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: ask for at least 1")
    from transformers import TextStreamer

    runtime = runtime_of(args)
    if runtime == "dtensor":
        started = started_per_device(args, args.nproc)
        if started is not None:
            return started
    model, tokenizer, load_seconds = load_model(args, "generate", "generate text")
    if runtime == "dtensor":
        return _run_dtensor(args, model, tokenizer, load_seconds)
    print(f"plan: {state_of(model).plan.summary()}", flush=True)
    ids = _prompt_ids(args, tokenizer)
    sampling = _sampling(args)
    compiles, compile_s = backend.compile_count(), backend.compile_seconds()
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = model.generate(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                         max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                         seed=args.seed, streamer=streamer, **sampling)
    stats = state_of(model).last_generate
    new = out.shape[1] - ids["input_ids"].shape[1]
    prompt_len = ids["input_ids"].shape[1]
    prefill_tps, decode_tps = stats.throughput(prompt_len)
    print(f"\nsummary: loaded in {load_seconds:.1f} s; {backend.compile_count() - compiles} programs "
          f"compiled in {backend.compile_seconds() - compile_s:.1f} s; prefill {prompt_len} tokens "
          f"at {prefill_tps:.1f} tokens/s, decode {stats.steps} steps at {decode_tps:.1f} tokens/s "
          f"(compilation excluded; host {stats.host_ms_per_token:.2f} ms per token, steps traced "
          f"{stats.traced}); {new} new tokens; buckets: batch {stats.batch_bucket}, "
          f"prompt {stats.prompt_bucket}, cache {stats.cache_length}")
    return 0
