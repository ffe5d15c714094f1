"""`autoxla generate PATH --prompt TEXT`: load sharded, stream the answer, then say what it cost.

The prompt goes through the checkpoint's chat template when it has one (--raw skips it). The
summary line counts what a user pays on an XLA device: load time, programs compiled and the time
spent compiling, prefill and decode throughput.
"""
from __future__ import annotations

import os
import time

from .. import backend
from ..loading.checkpoint import require_path_or_hub_id
from ..modeling import AutoXLAModelForCausalLM
from ..modeling.from_config import DTYPE_NAMES as dtypes
from ..quantization import QuantizationConfig
from ..sharding.hosts import SIMULATE_ENV
from ..state import state_of
from ..testing.real_model import chat_prompt


def add_arguments(p) -> None:
    p.add_argument("path", help="checkpoint directory (safetensors + config + tokenizer)")
    p.add_argument("--prompt", required=True, help="the text to answer")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--strategy", default="fsdp", help="fsdp, dp, mp, 2d or 3d (default fsdp)")
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices off a TPU (default 8)")
    p.add_argument("--dtype", default="auto", help="bf16, fp16, fp32 or auto (the checkpoint's)")
    p.add_argument("--bits", type=int, default=None, help="quantize linears to int8 (8) or int4 (4)")
    p.add_argument("--block-size", type=int, default=None,
                   help="elements per scale (-1: per channel; default: 32 for int4, -1 for int8)")
    p.add_argument("--attention", default="eager",
                   help="eager, xla_flash_attention or splash_attention (default eager)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--compile-cache", default=None, help="directory of the persistent compile cache")


def run(args) -> int:
    backend.use_cpu_devices(args.devices)
    require_path_or_hub_id(args.path)
    if os.environ.get(SIMULATE_ENV):
        # One process standing in for one host of several loads only that host's shards: the
        # other devices hold NaN, and the text would be garbage (docs/multihost.md).
        raise ValueError(f"{SIMULATE_ENV}={os.environ[SIMULATE_ENV]} is set: this process would "
                         "load one simulated host's shards only and generate garbage; unset it "
                         f"(unset {SIMULATE_ENV}) to generate text")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: ask for at least 1")
    from transformers import AutoTokenizer, TextStreamer

    dtype = "auto" if args.dtype == "auto" else dtypes.get(args.dtype.lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {args.dtype!r}; use auto or one of {', '.join(sorted(dtypes))}")
    quant = None
    if args.bits is not None:
        quant = QuantizationConfig(n_bits=args.bits, block_size=args.block_size)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{args.path} has no tokenizer transformers can load ({first}); "
                         "autoxla generate needs the tokenizer files saved beside the weights "
                         "(tokenizer.save_pretrained(PATH))") from e
    t0 = time.perf_counter()
    model = AutoXLAModelForCausalLM.from_pretrained(
        args.path, sharding_strategy=args.strategy, dtype=dtype, quantization_config=quant,
        attn_implementation=args.attention, compile_cache=args.compile_cache)
    load_seconds = time.perf_counter() - t0
    print(f"plan: {state_of(model).plan.summary()}", flush=True)
    templated = not args.raw and bool(tokenizer.chat_template)
    text = chat_prompt(tokenizer, args.prompt) if templated else args.prompt
    # The template already holds the special tokens; a raw prompt gets the tokenizer's own.
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not templated)
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k),
                                  ("top_p", args.top_p)) if v is not None}
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
