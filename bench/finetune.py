"""Fine-tuning, measured (issue 45): LoRA speed and memory against transformers + peft, the
programs a long run compiles, and QLoRA of a 7B-shaped checkpoint against the forecast.

    ./run python bench/finetune.py [--parts speed programs qlora7b] [--steps 12] [--batch 4]
        [--seq 128] [--program-steps 200] [--qlora-steps 10] [--qlora-seq 256]
        [--qlora-batch 1] [--qlora-devices 8] [--qlora-unrolled] [--cap 21]

Each side runs in a child process (fresh compile state, its peak RSS sampled by the parent every
20 ms and stopped at --cap GiB rather than left to the kernel's OOM killer).

- speed: the real SmolLM2-135M-Instruct (what `./run demo` converts), fp32, LoRA r=8 on the
  seven projections, AdamW, the same fixed [batch, seq] token batches on every side: AutoXLA on
  8 virtual XLA:CPU devices (fsdp, adapters placed by the plan, each micro-batch and optimizer
  step its own program, as the loop runs them) and on 1 (the same programs without collectives:
  8 virtual devices on 2 cores take turns), against transformers + peft's eager loop on the
  CPU. Tokens per second over the steps after the first two (which compile), and peak RSS.
- programs: AutoXLA's loop (`finetune`) for --program-steps steps on a tiny Llama from
  transformers' config class with SmolLM2's tokenizer, chat records of two length buckets,
  accumulation 2: programs compiled per step (metrics.jsonl's `compiles`), in total and after
  the first steps.
- qlora7b: bench/headline.py's Llama-2-7B-shaped bf16 checkpoint (13.5 GB, written once) loaded
  int4 under fsdp on --qlora-devices devices, the decoder stack scanned (the adapters stacked
  with it; --qlora-unrolled: scan_layers=False), LoRA r=8 (QLoRA), --qlora-steps AdamW steps on
  [batch, seq] random tokens: seconds per step, programs, and peak RSS against
  `autoxla plan --train --lora-rank 8 --bits 4`'s forecast (per device, times the devices: on
  XLA:CPU the virtual devices share the host's memory) plus the runtime's own resident memory.
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

from child import ROOT, child_env, run_sampled
from memory import rss

sys.path.insert(0, str(ROOT))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _batches(vocab: int, batch: int, seq: int, count: int = 2):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab - 1, (batch, seq), generator=g) for _ in range(count)]


def _lora():
    from peft import LoraConfig

    from AutoXLA.training import qlora
    return qlora(LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))


def _steps(model, batches, steps: int, device, finish=lambda: None, count=lambda: 0) -> dict:
    """``steps`` AdamW steps over ``batches`` in turn: seconds and programs per step.
    ``finish`` ends a program (on XLA: sync, then wait on XLA:CPU's shared rendezvous)."""
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    seconds, programs, losses = [], [], []
    for step in range(steps):
        ids = batches[step % len(batches)].to(device)
        t0, c0 = time.perf_counter(), count()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        finish()
        opt.step()
        opt.zero_grad()
        finish()
        losses.append(float(loss.detach().cpu()))          # the step's one look at the device
        seconds.append(time.perf_counter() - t0)
        programs.append(count() - c0)
    return {"seconds": seconds, "programs": programs, "losses": losses}


def _finish() -> None:
    from AutoXLA import backend

    backend.sync()
    backend.finish_step()


def speed_autoxla(path: str, batch: int, seq: int, steps: int) -> dict:
    import torch
    from peft import get_peft_model

    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.training import shard_adapters

    backend.device()
    runtime = rss()
    model = AutoXLAModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    sharding_strategy="fsdp", scan_layers=False)
    model = get_peft_model(model, _lora())
    shard_adapters(model)
    out = _steps(model, _batches(model.config.vocab_size, batch, seq), steps, backend.device(),
                 _finish, backend.compile_count)
    return {**out, "runtime_gib": runtime / 2**30}


def speed_eager(path: str, batch: int, seq: int, steps: int) -> dict:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    runtime = rss()
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           _lora())
    out = _steps(model, _batches(model.config.vocab_size, batch, seq), steps, torch.device("cpu"))
    return {**out, "runtime_gib": runtime / 2**30}


def programs(steps: int) -> dict:
    import torch
    from peft import get_peft_model
    from transformers import AutoTokenizer

    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.testing.real_model import smollm2_checkpoint
    from AutoXLA.testing.tiny import save_tiny_checkpoint
    from AutoXLA.training import FinetuneConfig, finetune

    tmp = Path(tempfile.mkdtemp(prefix="autoxla-finetune-bench-"))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    path = save_tiny_checkpoint("llama", tmp / "tiny", vocab_size=49152, bos_token_id=1,
                                eos_token_id=2, pad_token_id=2)
    records = []
    for i in range(40):          # short answers (bucket 64) and long ones (bucket 128)
        answer = " ".join(["the answer is", str(i)] + (["and more"] * 20 if i % 2 else []))
        records.append({"messages": [{"role": "user", "content": f"Question {i}?"},
                                     {"role": "assistant", "content": answer}]})
    model = AutoXLAModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    sharding_strategy="fsdp", scan_layers=False)
    model = get_peft_model(model, _lora())
    config = FinetuneConfig(steps=steps, batch_size=4, grad_accum=2, lr=1e-3, warmup_steps=10,
                            buckets=(64, 128), seed=0)
    t0 = time.perf_counter()
    result = finetune(model, tokenizer, records, config, tmp / "run", progress=False)
    per_step = [r["compiles"] for r in result.steps]
    return {"per_step": per_step, "seconds": time.perf_counter() - t0,
            "first_loss": result.steps[0]["loss"], "last_loss": result.steps[-1]["loss"]}


def qlora7b(path: str, batch: int, seq: int, steps: int, scan: bool = True) -> dict:
    from peft import get_peft_model

    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.planning.memory import TrainingSetup, training_forecast
    from AutoXLA.quantization import QuantizationConfig
    from AutoXLA.state import state_of
    from AutoXLA.training import shard_adapters

    backend.device()
    runtime = rss()
    t0 = time.perf_counter()
    model = AutoXLAModelForCausalLM.from_pretrained(
        path, sharding_strategy="fsdp", scan_layers=scan, do_quant=True,
        quantization_config=QuantizationConfig(bits=4))
    backend.sync()
    load_s, loaded = time.perf_counter() - t0, rss()
    model = get_peft_model(model, _lora())
    planned = shard_adapters(model)
    plan = state_of(model.get_base_model()).plan
    forecast = training_forecast(plan, model.config, TrainingSetup(batch, seq))
    out = _steps(model, _batches(model.config.vocab_size, batch, seq), steps, backend.device(),
                 _finish, backend.compile_count)
    return {**out, "runtime_gib": runtime / 2**30, "loaded_gib": loaded / 2**30, "load_s": load_s,
            "devices": plan.mesh.num_devices, "adapters": planned.parameters(),
            "forecast": forecast.to_dict(), "forecast_text": forecast.describe()}


def spawn(args_list: list[str], cap: float, devices: int = 8) -> dict:
    """This script as a child on ``devices`` devices, stopped above ``cap`` GiB of RSS."""
    return run_sampled([sys.executable, __file__, *args_list], child_env(devices), cap)


def _tokens_per_s(r: dict, tokens_per_step: int) -> float:
    later = r["seconds"][2:] or r["seconds"]
    return tokens_per_step * len(later) / sum(later)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["speed", "programs", "qlora7b"],
                    choices=["speed", "programs", "qlora7b"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--program-steps", type=int, default=200)
    ap.add_argument("--qlora-steps", type=int, default=10)
    ap.add_argument("--qlora-seq", type=int, default=256)
    ap.add_argument("--qlora-batch", type=int, default=1)
    ap.add_argument("--qlora-devices", type=int, default=8)
    ap.add_argument("--qlora-unrolled", action="store_true", help="load the 7B decoder stack "
                    "unrolled (scan_layers=False) instead of scanned")
    ap.add_argument("--cap", type=float, default=21.0, help="GiB of RSS at which a child stops")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = {"speed_autoxla": lambda: speed_autoxla(args.path, args.batch, args.seq, args.steps),
              "speed_eager": lambda: speed_eager(args.path, args.batch, args.seq, args.steps),
              "programs": lambda: programs(args.program_steps),
              "qlora7b": lambda: qlora7b(args.path, args.qlora_batch, args.qlora_seq,
                                         args.qlora_steps, not args.qlora_unrolled)}[args.child]
        print(json.dumps(fn()))
        return 0

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{mem:.1f} GiB RAM")
    common = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    if "speed" in args.parts:
        from AutoXLA.testing.real_model import smollm2_checkpoint

        path = str(smollm2_checkpoint())
        tokens = args.batch * args.seq
        print(f"\nspeed: SmolLM2-135M fp32, LoRA r=8, batch {args.batch} x seq {args.seq}, "
              f"{args.steps} steps (tokens/s over steps 3..{args.steps})")
        rows = {}
        for key, side, devices, name in (
                ("autoxla", "speed_autoxla", 8, "autoxla, 8 XLA:CPU devices, fsdp"),
                ("autoxla1", "speed_autoxla", 1, "autoxla, 1 XLA:CPU device"),
                ("eager", "speed_eager", 8, "transformers + peft, eager CPU")):
            r = rows[key] = spawn(["--child", side, "--path", path, *common], args.cap, devices)
            if "error" in r:
                print(f"  {name}: {r['error']}")
                continue
            print(f"  {name:36s} {_tokens_per_s(r, tokens):8.1f} tokens/s  peak RSS "
                  f"{r['peak_gib']:.2f} GiB (runtime before the model {r['runtime_gib']:.2f})  "
                  f"programs per step {r['programs']}")
        if all("error" not in r for r in rows.values()):
            eager = _tokens_per_s(rows["eager"], tokens)
            print(f"  ratio autoxla / eager: {_tokens_per_s(rows['autoxla'], tokens) / eager:.2f}x "
                  f"tokens/s on 8 devices, {_tokens_per_s(rows['autoxla1'], tokens) / eager:.2f}x "
                  f"on 1; losses at step 1 {rows['autoxla']['losses'][0]:.5f} / "
                  f"{rows['autoxla1']['losses'][0]:.5f} / {rows['eager']['losses'][0]:.5f}")
    if "programs" in args.parts:
        r = spawn(["--child", "programs", "--program-steps", str(args.program_steps)], args.cap)
        print(f"\nprograms: AutoXLA's loop, {args.program_steps} steps, tiny Llama, buckets 64 and "
              "128, accumulation 2")
        if "error" in r:
            print(f"  {r['error']}")
        else:
            per = r["per_step"]
            first = next((i for i in range(len(per)) if sum(per[i:]) == 0), len(per))
            print(f"  {sum(per)} programs in all, per step {per[:8]}...; none from step "
                  f"{first + 1} to {len(per)} ({len(per) - first} steps with 0 compilations); "
                  f"{r['seconds']:.0f} s; loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}")
    if "qlora7b" in args.parts:
        from headline import CACHE, write_checkpoint

        path = write_checkpoint(CACHE / "llama2-7b-shape")
        print(f"\nqlora7b: {path}, int4, fsdp on {args.qlora_devices} XLA:CPU devices, "
              f"{'unrolled' if args.qlora_unrolled else 'scanned'}, LoRA r=8, "
              f"batch {args.qlora_batch} x seq {args.qlora_seq}, {args.qlora_steps} steps")
        r = spawn(["--child", "qlora7b", "--path", str(path), "--qlora-batch",
                   str(args.qlora_batch), "--qlora-seq", str(args.qlora_seq), "--qlora-steps",
                   str(args.qlora_steps), *(["--qlora-unrolled"] if args.qlora_unrolled else [])],
                  args.cap, args.qlora_devices)
        if "error" in r:
            print(f"  {r['error']} after {r['wall_s']:.0f} s")
        else:
            per_device = r["forecast"]["total_bytes_per_device"] / 2**30
            expected = per_device * r["devices"] + r["runtime_gib"]
            print(r["forecast_text"])
            print(f"  loaded in {r['load_s']:.0f} s; {r['adapters']:,} adapter parameters; "
                  f"seconds per step {[round(s) for s in r['seconds']]}; programs per step "
                  f"{r['programs']}; losses {[round(x, 3) for x in r['losses']]}")
            print(f"  peak RSS {r['peak_gib']:.2f} GiB against the forecast {per_device:.2f} GiB "
                  f"per device x {r['devices']} + the runtime's {r['runtime_gib']:.2f} GiB = "
                  f"{expected:.2f} GiB: measured / forecast {r['peak_gib'] / expected:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
