"""Compile time, peak memory and speed against depth: scanned decoder stack vs unrolled.

Llama-shaped bf16 checkpoints of one width and 2, 8 and 32 layers (random weights, written once
under ~/.cache/autoxla/bench/), each loaded on 8 virtual XLA:CPU devices under one strategy, with
``scan_layers=True`` and ``False``. Every (depth, side) runs in a fresh process, so that compiled
programs and the peak RSS are its own. Each child measures:

- forward: compile time (torch_xla's CompileTime metric) of one forward of a batch, and the peak
  RSS above the loaded model during it (sampled every 2 ms), then the steady time of that forward;
- decode: ``generate`` of a fixed number of greedy tokens: compile time of the prefill and decode
  programs, peak RSS above the loaded model, and decode tokens/s of a second, identical call.

    ./run python bench/depth.py [--layers 2 8 32] [--strategy fsdp] [--hidden 512] [--dtype float32]

Prints one table, and per depth the unrolled/scanned ratios. What to look for: the scanned
columns stay flat with depth (compile time and forward memory), the unrolled ones grow; scanned
decode tokens/s within 10 % of unrolled.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from child import run_json_child
from memory import PeakRSS, rss

CACHE = Path(os.environ.get("AUTOXLA_BENCH_CACHE", Path.home() / ".cache" / "autoxla" / "bench"))


def checkpoint(layers: int, hidden: int, dtype: str = "bfloat16") -> Path:
    """A Llama-shaped checkpoint of ``layers`` layers (written once, then reused)."""
    path = CACHE / f"depth-h{hidden}-l{layers}" if dtype == "bfloat16" else \
        CACHE / f"depth-h{hidden}-l{layers}-{dtype}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(hidden // 256, 1), max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(layers)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="200MB")
    tmp.rename(path)
    return path


def child(path: str, scan: bool, strategy: str, batch: int, seq: int, tokens: int) -> dict:
    import torch

    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy,
                                                    scan_layers=scan)
    backend.sync()
    dev = backend.device()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 2000, (batch, seq), generator=g).to(dev)
    out = {"scanned": model.autoxla_plan.stack.scanned, "loaded_gib": rss() / 2**30}

    def forward():
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        backend.sync()
        return logits

    c0, s0 = backend.compile_count(), backend.compile_seconds()
    with PeakRSS() as peak:
        forward()
    out.update(forward_compiles=backend.compile_count() - c0,
               forward_compile_s=backend.compile_seconds() - s0, forward_peak_gib=peak.above)
    t0 = time.perf_counter()
    for _ in range(3):
        forward()
    out["forward_s"] = (time.perf_counter() - t0) / 3

    prompt = ids[:1, :16]
    args = dict(max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    c0, s0 = backend.compile_count(), backend.compile_seconds()
    with PeakRSS() as peak:
        first = model.generate(prompt, **args).cpu()
    out.update(decode_compiles=backend.compile_count() - c0,
               decode_compile_s=backend.compile_seconds() - s0, decode_peak_gib=peak.above)
    second = model.generate(prompt, **args).cpu()
    stats = model.autoxla_last_generate
    out["decode_tps"] = stats.throughput(16)[1]
    out["same_tokens_twice"] = bool(torch.equal(first, second))
    out["tokens"] = second[0, 16:].tolist()
    return out


def spawn(path: Path, scan: bool, args) -> dict:
    t0 = time.perf_counter()
    result = run_json_child([__file__, "--child", str(path), "--scan", str(int(scan)),
                             "--strategy", args.strategy, "--batch", str(args.batch),
                             "--seq", str(args.seq), "--tokens", str(args.tokens)], args.limit)
    result["wall_s"] = time.perf_counter() - t0
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--strategy", default="fsdp")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32 weights")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--limit", type=float, default=1800)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--scan", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, bool(args.scan), args.strategy, args.batch, args.seq,
                               args.tokens)))
        return 0

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"8 virtual XLA:CPU devices, strategy {args.strategy}; hidden {args.hidden}, {args.dtype}; "
          f"forward batch {args.batch} x {args.seq}; decode {args.tokens} tokens, batch 1")
    cols = ("layers", "side", "fwd compile s", "fwd peak GiB", "fwd s", "dec compile s",
            "dec peak GiB", "dec tok/s", "programs")
    print(" | ".join(cols))
    rows = {}
    for layers in args.layers:
        path = checkpoint(layers, args.hidden, args.dtype)
        for scan in (True, False):
            r = rows[layers, scan] = spawn(path, scan, args)
            side = "scanned" if scan else "unrolled"
            if "error" in r:
                print(f"{layers} | {side} | {r['error']}")
                continue
            if scan and not r["scanned"]:
                side = "scanned?! (plan refused)"
            print(f"{layers} | {side} | {r['forward_compile_s']:.1f} | {r['forward_peak_gib']:.2f} | "
                  f"{r['forward_s']:.2f} | {r['decode_compile_s']:.1f} | {r['decode_peak_gib']:.2f} | "
                  f"{r['decode_tps']:.1f} | {r['forward_compiles']}+{r['decode_compiles']}",
                  flush=True)
    print("\nratios unrolled / scanned (compile time, forward peak memory above the model, decode "
          "tokens/s) and whether both sides generated the same tokens:")
    for layers in args.layers:
        s, u = rows[layers, True], rows[layers, False]
        if "error" in s or "error" in u:
            continue
        print(f"{layers} layers: forward compile x{u['forward_compile_s'] / s['forward_compile_s']:.2f}, "
              f"decode compile x{u['decode_compile_s'] / s['decode_compile_s']:.2f}, forward memory "
              f"x{u['forward_peak_gib'] / max(s['forward_peak_gib'], 1e-3):.2f}, decode speed "
              f"scanned/unrolled {s['decode_tps'] / u['decode_tps']:.2f}, same tokens "
              f"{s['tokens'] == u['tokens']}")
    scanned = [rows[n, True] for n in args.layers if "error" not in rows[n, True]]
    if len(scanned) > 1:
        lo, hi = scanned[0], scanned[-1]
        print(f"scanned forward compile, {args.layers[-1]} vs {args.layers[0]} layers: "
              f"x{hi['forward_compile_s'] / lo['forward_compile_s']:.2f} (goal: within 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
