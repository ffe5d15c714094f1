"""`autoxla serve PATH`: load sharded (and quantized) as `generate` does, compile every program
the traffic can need with a progress bar, then serve OpenAI's completions and chat completions
with continuous batching until interrupted (docs/serving.md)."""
from __future__ import annotations

from pathlib import Path

from ..serving import ServeConfig, serve
from ..state import state_of
from .model_args import add_model_arguments, load_model


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8,
                   help="sequences decoded together: the slots of the KV cache (default 8)")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="the longest prompt accepted (default 512)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="the most new tokens one request may ask (default 256)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="sequences waiting for a slot before new requests get 429; a request "
                        "of more sequences than this (prompts x n) is a 400 (default 256)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take, queue included (default 600)")
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on Ctrl-C or SIGTERM: new requests get 503 at once, running ones get "
                        "this long to finish, then are cut (default 30)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="the largest request body, refused (413) before it is read (default: 16 "
                        "bytes per token of a full queue of the longest prompts, at least 1 MiB)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client may take to send a request's headers before its "
                        "connection is closed; a pause as long inside a body is a 408 "
                        "(default 10)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections served at once; a request on one more gets 503 "
                        "(default: max-batch + max-queue + 64)")
    p.add_argument("--model-name", default=None,
                   help="the model's id in the API (default: the checkpoint folder's name)")


def run(args) -> int:
    config = ServeConfig(slots=args.max_batch, max_prompt_tokens=args.max_prompt_tokens,
                         max_tokens=args.max_tokens, max_queue=args.max_queue,
                         request_timeout=args.request_timeout,
                         drain_seconds=args.drain_seconds, max_body_bytes=args.max_body_bytes,
                         header_timeout=args.header_timeout,
                         max_connections=args.max_connections,
                         model_name=args.model_name or Path(args.path).name)
    model, tokenizer, seconds = load_model(args, "serve", "serve", runtimes_supported=("xla",))
    print(f"plan: {state_of(model).plan.summary()} (loaded in {seconds:.1f} s)", flush=True)
    serve(model, tokenizer, config, host=args.host, port=args.port)
    return 0
