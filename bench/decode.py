"""Decode speed and the host's share of it: transformers' eager loop on the CPU against AutoXLA's
generate with its steps traced every token (as before issue 29) and traced once (now).

In one run, for the tiny Llama fixture (host bound: its device work is near zero) and the real
SmolLM2-135M-Instruct (fp32 on both sides), at batch 1, 8 and 32, on 1 and on 8 virtual XLA:CPU
devices (fsdp): decode tokens/s and the host's CPU time per decode token. Each (model, devices)
runs in a fresh process; every AutoXLA figure is a second, identical call (everything compiled).
Greedy tokens are compared with transformers' on the CPU.

    ./run python bench/decode.py [--tokens 32] [--batches 1 8 32] [--models tiny smollm2]
                                 [--limit 1800]

Host ms per token: this thread's CPU time issuing the decode steps (Stats.decode_host_seconds);
for transformers' eager loop all of its time is host time. Device ms per token: the rest of the
decode wall time (waiting for the devices). Ends with a profile of one traced-once call of the
tiny model on 1 device: where the remaining host time goes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from child import decode_checkpoints, run_json_child

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is a city where"


def _prompts(tokenizer, batch: int):
    import torch

    if tokenizer is None:       # the tiny model: token ids
        ids = torch.arange(5, 21).repeat(batch, 1)
    else:
        ids = tokenizer([PROMPT] * batch, return_tensors="pt").input_ids
    return ids, torch.ones_like(ids)


def eager(model_path: str, tokenizer_path: str | None, batches, tokens: int) -> dict:
    """transformers' own generate on the CPU, fp32: decode tokens/s from N and 1 new tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count())
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else None
    out = {}
    for batch in batches:
        ids, mask = _prompts(tok, batch)
        args = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

        def run(n):
            t0 = time.perf_counter()
            got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, **args)
            return time.perf_counter() - t0, got

        run(2)                                             # warm-up
        one, _ = run(1)
        full, got = run(tokens)
        per_token = (full - one) / (tokens - 1)
        out[batch] = {"tps": batch / per_token, "host_ms": 1000 * per_token,
                      "tokens": got[:, ids.shape[1]:].tolist()}
    return out


def autoxla(model_path: str, tokenizer_path: str | None, batches, tokens: int,
            profile: bool) -> dict:
    """Runs in a child: every batch, steps traced every token ('before') and once ('after')."""
    import torch
    from transformers import AutoTokenizer

    from AutoXLA import backend
    from AutoXLA.generation import GenerationOptions
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    model = AutoXLAModelForCausalLM.from_pretrained(model_path, sharding_strategy="fsdp",
                                                    dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else None
    dev = backend.device()
    out = {}
    for batch in batches:
        ids, mask = _prompts(tok, batch)
        for side, once in (("before", False), ("after", True)):
            model.autoxla_generation = GenerationOptions(trace_steps_once=once)
            args = dict(max_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
            model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args)  # compiles
            c0 = backend.compile_count()
            got = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args)
            s = model.autoxla_last_generate
            out[f"{side} {batch}"] = {
                "tps": batch * s.steps / (s.decode_seconds - s.decode_compile_seconds),
                "host_ms": s.host_ms_per_token, "device_ms": s.device_ms_per_token,
                "compiled": backend.compile_count() - c0, "traced": s.traced,
                "tokens": got.cpu()[:, ids.shape[1]:].tolist()}
    if profile:
        out["profile"] = _profile(model, _prompts(tok, 1), tokens, dev)
    return out


def _profile(model, prompt, tokens: int, dev) -> str:
    import cProfile
    import io
    import pstats

    ids, mask = prompt
    args = dict(max_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    profiler = cProfile.Profile()
    profiler.enable()
    model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    return text.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    p.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    p.add_argument("--limit", type=float, default=1800, help="seconds per process")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        model_path, tokenizer_path, profile = a.child
        print(json.dumps(autoxla(model_path, tokenizer_path or None, a.batches, a.tokens,
                                 profile == "1")))
        return 0
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; greedy, {a.tokens} new tokens after a 16-token "
          "(tiny) or 9-token (SmolLM2) prompt, fp32; AutoXLA under fsdp")
    with tempfile.TemporaryDirectory() as tmp:
        paths = decode_checkpoints(a.models, tmp)
        print(f"{'model':<8} {'batch':>5} {'side':<22} {'tok/s':>8} {'host ms/tok':>11} "
              f"{'device ms/tok':>13}  note")
        for name, (path, tokenizer) in paths.items():
            reference = eager(path, tokenizer or None, a.batches, a.tokens)
            for batch in a.batches:
                r = reference[batch]
                print(f"{name:<8} {batch:>5} {'transformers eager CPU':<22} {r['tps']:>8.1f} "
                      f"{r['host_ms']:>11.2f} {'-':>13}")
            for devices in a.devices:
                profile = "1" if name == "tiny" and devices == 1 else "0"
                got = run_json_child([__file__, "--tokens", str(a.tokens), "--batches",
                                      *map(str, a.batches), "--child", path, tokenizer, profile],
                                     a.limit, devices=devices)
                if "error" in got:
                    print(f"{name:<8} {'':>5} AutoXLA on {devices} device(s): {got['error']}")
                    continue
                for batch in a.batches:
                    for side in ("before", "after"):
                        r = got[f"{side} {batch}"]
                        same = r["tokens"] == reference[batch]["tokens"]
                        note = (f"{r['compiled']} compiled; traced {r['traced']}; tokens "
                                f"{'equal' if same else 'DIFFER from'} transformers'")
                        label = f"AutoXLA {devices}d {side}"
                        print(f"{name:<8} {batch:>5} {label:<22} {r['tps']:>8.1f} "
                              f"{r['host_ms']:>11.2f} {r['device_ms']:>13.2f}  {note}")
                    before, after = got[f"before {batch}"], got[f"after {batch}"]
                    print(f"{'':<8} {'':>5} ratio after/before: {after['tps'] / before['tps']:.1f}x "
                          f"tok/s, host {before['host_ms'] / max(after['host_ms'], 1e-9):.1f}x "
                          f"less; after/eager {after['tps'] / reference[batch]['tps']:.2f}x tok/s")
                if "profile" in got:
                    print(f"\nWhere the host time of one traced-once call goes ({name}, 1 device, "
                          "batch 1, cProfile, by own time):")
                    print(got["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
