"""The headline: a Llama-2-7B-shaped checkpoint, int8 and sharded on 8 devices, on one machine.

Writes a 7B-shaped bf16 checkpoint once (random weights, 13.5 GB in 8 safetensors files, under
~/.cache/autoxla/bench/llama2-7b-shape), then runs two children side by side:

- autoxla: ``from_pretrained(..., do_quant=True)`` (int8 per channel) under ``fsdp`` on 8 virtual
  XLA:CPU devices, with the decoder stack scanned (the default); one forward of 16 tokens; then
  ``generate`` of 32 greedy tokens with the static KV cache. Each phase's wall time, programs
  compiled and peak RSS.
- transformers: plain ``AutoModelForCausalLM.from_pretrained(dtype=bfloat16)`` then
  ``.to(xla)``: the load a torch_xla user writes by hand; time and peak RSS (the parent stops it
  at --cap GiB rather than let the kernel's OOM killer choose a victim).

    ./run python bench/headline.py [--strategy fsdp] [--tokens 32] [--cap 21] [--skip-transformers]

The goal (issue 11): load <= 60 s, peak RSS <= the quantized model + 2 GiB, a forward and 32
tokens. Random weights: the tokens mean nothing, the shapes, bytes and programs are real.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from child import child_env, run_sampled
from memory import PeakRSS, rss

CACHE = Path(os.environ.get("AUTOXLA_BENCH_CACHE", Path.home() / ".cache" / "autoxla" / "bench"))
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)


def write_checkpoint(path: Path, files: int = 8) -> Path:
    """The 7B-shaped bf16 checkpoint, one tensor in memory at a time; reused once complete."""
    if (path / "config.json").exists():
        return path
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**LLAMA2_7B)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    total = sum(torch.Size(s).numel() * 2 for _, s in shapes)
    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weight_map, group, size, index = {}, {}, 0, 0
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    t0 = time.perf_counter()
    for k, (name, shape) in enumerate(shapes):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        group[name] = t
        size += t.numel() * 2
        last = k == len(shapes) - 1
        if last or size >= total / files and index < files - 1:
            save_file(group, str(tmp / names[index]), metadata={"format": "pt"})
            weight_map.update({n: names[index] for n in group})
            print(f"  wrote {names[index]} ({size / 2**30:.2f} GiB, {time.perf_counter() - t0:.0f} s)",
                  flush=True)
            group, size, index = {}, 0, index + 1
    if index < files:        # fewer groups than files: rename so the names say "of N" truly
        for i in range(index):
            final = f"model-{i + 1:05d}-of-{index:05d}.safetensors"
            (tmp / names[i]).rename(tmp / final)
            weight_map = {n: (final if f == names[i] else f) for n, f in weight_map.items()}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(tmp)
    tmp.rename(path)
    return path


def autoxla(path: str, strategy: str, tokens: int) -> dict:
    import torch

    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.quantization import QuantizationConfig

    backend.device()
    out = {"runtime_gib": rss() / 2**30}    # torch, transformers, torch_xla and 8 devices, no model
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        model = AutoXLAModelForCausalLM.from_pretrained(
            path, sharding_strategy=strategy, do_quant=True,
            quantization_config=QuantizationConfig(bits=8))
        backend.sync()
        backend.wait_for_transfers()
        out["load_s"] = time.perf_counter() - t0
    plan = model.autoxla_plan
    out.update(load_peak_gib=peak.gib, model_gib=plan.total_bytes() / 2**30,
               stack=plan.stack.describe(), loaded_gib=rss() / 2**30)
    dev = backend.device()
    ids = torch.randint(3, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
    with PeakRSS() as peak:
        c0, t0 = backend.compile_count(), time.perf_counter()
        with torch.no_grad():
            logits = model(input_ids=ids.to(dev), use_cache=False).logits
        finite = bool(torch.isfinite(logits.cpu()).all())
        out.update(forward_s=time.perf_counter() - t0, forward_compiles=backend.compile_count() - c0,
                   forward_finite=finite)
    out["forward_peak_gib"] = peak.gib
    with PeakRSS() as peak:
        c0, t0 = backend.compile_count(), time.perf_counter()
        got = model.generate(ids.to(dev), max_new_tokens=tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0).cpu()
        out.update(generate_s=time.perf_counter() - t0,
                   generate_compiles=backend.compile_count() - c0,
                   new_tokens=got.shape[1] - ids.shape[1])
    stats = model.autoxla_last_generate
    out.update(generate_peak_gib=peak.gib, decode_tps=stats.throughput(16)[1],
               compile_s=stats.prefill_compile_seconds + stats.decode_compile_seconds)
    return out


def transformers_load(path: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from AutoXLA import backend

    dev = backend.device()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    host_s = time.perf_counter() - t0
    model.to(dev)
    backend.sync()
    backend.wait_for_transfers()
    return {"load_s": time.perf_counter() - t0, "host_load_s": host_s, "loaded_gib": rss() / 2**30}


def spawn(side: str, path: Path, args) -> dict:
    """Runs one side in a child, stopped above ``args.cap`` GiB of RSS."""
    cmd = [sys.executable, __file__, "--child", side, "--path", str(path),
           "--strategy", args.strategy, "--tokens", str(args.tokens)]
    return run_sampled(cmd, child_env(), args.cap)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="fsdp")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cap", type=float, default=21.0, help="GiB of RSS at which a side is stopped")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = autoxla if args.child == "autoxla" else (lambda p, s, t: transformers_load(p))
        print(json.dumps(fn(args.path, args.strategy, args.tokens)))
        return 0

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{mem:.1f} GiB RAM; 8 virtual XLA:CPU devices, strategy {args.strategy}")
    t0 = time.perf_counter()
    path = write_checkpoint(CACHE / "llama2-7b-shape")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30
    print(f"checkpoint: {path} ({size:.1f} GiB bf16; ready in {time.perf_counter() - t0:.0f} s)")

    a = spawn("autoxla", path, args)
    if "error" in a:
        print(f"autoxla: {a['error']} (peak RSS {a['peak_gib']:.1f} GiB)")
    else:
        print(f"autoxla int8 {args.strategy}: {a['stack']}")
        print(f"  load     {a['load_s']:6.1f} s   peak RSS {a['load_peak_gib']:5.2f} GiB "
              f"(quantized model {a['model_gib']:.2f} GiB; {a['loaded_gib']:.2f} GiB once loaded)")
        print(f"  forward  {a['forward_s']:6.1f} s   peak RSS {a['forward_peak_gib']:5.2f} GiB   "
              f"{a['forward_compiles']} programs compiled; logits finite: {a['forward_finite']}")
        print(f"  generate {a['generate_s']:6.1f} s   peak RSS {a['generate_peak_gib']:5.2f} GiB   "
              f"{a['new_tokens']} tokens, {a['generate_compiles']} programs ({a['compile_s']:.1f} s "
              f"compiling), decode {a['decode_tps']:.2f} tokens/s")
        print(f"  whole process: peak RSS {a['peak_gib']:.2f} GiB = quantized model + "
              f"{a['peak_gib'] - a['model_gib']:.2f} GiB (goal <= + 2 GiB; of it, the runtime "
              f"before any model: {a['runtime_gib']:.2f} GiB); load goal <= 60 s")
    if args.skip_transformers:
        return 0
    t = spawn("transformers", path, args)
    if "error" in t:
        print(f"transformers bf16 + .to(xla): {t['error']}")
    else:
        print(f"transformers bf16 + .to(xla): load {t['load_s']:.1f} s (host {t['host_load_s']:.1f} s), "
              f"peak RSS {t['peak_gib']:.2f} GiB")
    if "error" not in a and "error" not in t:
        print(f"ratio transformers / autoxla: load time x{t['load_s'] / a['load_s']:.2f}, "
              f"peak RSS x{t['peak_gib'] / a['peak_gib']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
