"""Continuous batching against one request at a time: the same requests, in one run, sent to
`autoxla serve`'s server by N concurrent streaming clients on loopback, and sent one after
another to ``model.generate`` in the same process.

For the tiny Llama (SmolLM2's tokenizer, random weights) and the real SmolLM2-135M-Instruct, each
in a fresh process: throughput (generated tokens per second of wall time), time to first token
and inter-token latency (p50, p99), and the programs compiled while serving (0 expected). Greedy,
a fixed number of new tokens per request (EOS ignored: vLLM's ``ignore_eos``), so both sides
generate exactly the same tokens.

    ./run python bench/serve.py [--clients 16] [--tokens 32] [--devices 1] [--models tiny smollm2]

Sequential TTFT is the prefill (with the request's own first token), its inter-token latency
the decode time per token; on the server both are what a streaming client sees.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

from child import run_json_child

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["the ocean", "trains", "a lighthouse", "autumn", "coffee", "mountains", "the moon",
          "a library", "rain", "bicycles", "a garden", "the desert", "music", "snow",
          "a market", "bridges", "owls", "the city at night", "bread", "a river"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}."
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(templated, add_special_tokens=False)["input_ids"])
    return out


def percentile(values, q: float) -> float:
    import statistics

    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def sequential(model, ids_list, tokens: int) -> dict:
    import torch

    from AutoXLA.state import state_of

    # warm-up: every bucket these prompts use, compiled before the clock starts
    for ids in {len(i): i for i in ids_list}.values():
        model.generate(input_ids=torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                       eos_token_id=None)
    ttft, itl, generated = [], [], 0
    t0 = time.perf_counter()
    for ids in ids_list:
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=tokens,
                             do_sample=False, eos_token_id=None)
        stats = state_of(model).last_generate
        generated += out.shape[1] - len(ids)
        ttft.append(stats.prefill_seconds)
        itl.extend([stats.decode_seconds / max(stats.steps, 1)] * stats.steps)
    wall = time.perf_counter() - t0
    return dict(wall=wall, tokens=generated, ttft=ttft, itl=itl)


def served(model, tokenizer, ids_list, tokens: int, clients: int) -> dict:
    from openai import OpenAI

    from AutoXLA import backend
    from AutoXLA.serving import Background, ServeConfig, Server

    longest = max(len(i) for i in ids_list)
    server = Server(model, tokenizer, ServeConfig(slots=clients, max_prompt_tokens=longest,
                                                  max_tokens=tokens, model_name="bench"))
    t0 = time.perf_counter()
    compiled = server.warm_up(progress=False)
    warm = time.perf_counter() - t0
    web = Background(server)
    api = OpenAI(base_url=web.url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    before = backend.compile_count()
    results = [None] * len(ids_list)

    def client(i):
        start = time.perf_counter()
        stamps, count = [], 0
        for chunk in api.completions.create(model="bench", prompt=ids_list[i], max_tokens=tokens,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].finish_reason is None:
                stamps.append(time.perf_counter())
                count += 1
        results[i] = (start, stamps, count)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ids_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    compiled_serving = backend.compile_count() - before
    web.stop()
    ttft = [stamps[0] - start for start, stamps, _ in results]
    itl = [b - a for _, stamps, _ in results for a, b in zip(stamps, stamps[1:])]
    return dict(wall=wall, tokens=sum(c for _, _, c in results), ttft=ttft, itl=itl,
                warm_up_programs=compiled, warm_up_seconds=warm,
                compiled_while_serving=compiled_serving)


def child(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    backend.use_cpu_devices(args.devices)
    tokenizer = AutoTokenizer.from_pretrained(args.path)
    model = AutoXLAModelForCausalLM.from_pretrained(args.path, sharding_strategy="fsdp",
                                                    dtype=torch.float32)
    ids_list = prompts(tokenizer, args.clients)
    seq = sequential(model, ids_list, args.tokens)
    srv = served(model, tokenizer, ids_list, args.tokens, args.clients)
    summary = {}
    for name, r in (("sequential", seq), ("served", srv)):
        summary[name] = dict(
            tokens=r["tokens"], wall=r["wall"], tokens_per_s=r["tokens"] / r["wall"],
            ttft_p50=percentile(r["ttft"], 50), ttft_p99=percentile(r["ttft"], 99),
            itl_p50=percentile(r["itl"], 50), itl_p99=percentile(r["itl"], 99))
    summary["served"].update({k: srv[k] for k in ("warm_up_programs", "warm_up_seconds",
                                                  "compiled_while_serving")})
    return summary


def tiny_checkpoint(directory: Path, tokenizer_path: Path) -> Path:
    from transformers import AutoTokenizer

    from AutoXLA.testing.tiny import save_tiny_checkpoint

    path = save_tiny_checkpoint("llama", directory, vocab_size=49152, bos_token_id=1,
                                eos_token_id=2, pad_token_id=2)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    p.add_argument("--limit", type=float, default=3600, help="seconds per model process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    sys.path.insert(0, str(ROOT))
    from AutoXLA.testing.real_model import smollm2_checkpoint

    real = smollm2_checkpoint()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}; {args.clients} clients x {args.tokens} tokens, greedy, "
          f"fsdp on {args.devices} virtual XLA:CPU device(s), fp32")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"tiny": lambda: tiny_checkpoint(Path(tmp) / "tiny", real),
                 "smollm2": lambda: real}
        print("| model | side | tokens | wall s | tokens/s | TTFT p50 / p99 ms | "
              "ITL p50 / p99 ms |")
        print("|---|---|---|---|---|---|---|")
        ratios = {}
        for name in args.models:
            path = paths[name]()
            cmd = [__file__, "--child", "--path", str(path), "--clients", str(args.clients),
                   "--tokens", str(args.tokens), "--devices", str(args.devices)]
            r = run_json_child(cmd, args.limit, devices=args.devices)
            if "error" in r:
                print(f"| {name} | {r['error']} |  |  |  |  |  |", flush=True)
                continue
            for side in ("sequential", "served"):
                s = r[side]
                print(f"| {name} | {side} | {s['tokens']} | {s['wall']:.1f} | "
                      f"{s['tokens_per_s']:.1f} | {1000 * s['ttft_p50']:.0f} / "
                      f"{1000 * s['ttft_p99']:.0f} | {1000 * s['itl_p50']:.1f} / "
                      f"{1000 * s['itl_p99']:.1f} |", flush=True)
            ratios[name] = r["served"]["tokens_per_s"] / r["sequential"]["tokens_per_s"]
            print(f"|  | {name}: served / sequential throughput x{ratios[name]:.2f}; warm-up "
                  f"{r['served']['warm_up_programs']} programs in "
                  f"{r['served']['warm_up_seconds']:.1f} s; compiled while serving: "
                  f"{r['served']['compiled_while_serving']} |  |  |  |  |  |", flush=True)
    if "smollm2" in ratios:
        print(f"goal: continuous batching >= 4x sequential on the real model at {args.clients} "
              f"clients: x{ratios['smollm2']:.2f} ({'met' if ratios['smollm2'] >= 4 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
