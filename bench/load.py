"""Loading a ~1 GB bf16 checkpoint under fsdp on 8 XLA:CPU devices: AutoXLA vs the naive path.

    ./run python bench/load.py [--size-gb 1.0] [--dir DIR]

Each path runs in its own fresh process (so neither inherits the other's heap), one after the
other in one run of this script. Reported per path: wall time, and transient host memory = peak
RSS during loading minus RSS after loading (after malloc_trim, so freed heap is not counted as
kept). XLA:CPU keeps device buffers in host RAM, so the final RSS holds the model itself; the
transient is what loading costs on top. Also printed: peak minus RSS before minus the model's
bytes, the same overhead measured from the other end.

  naive:   transformers.from_pretrained on the CPU, then .to(xla), then mark_sharding per the plan
  autoxla: AutoXLAModelForCausalLM.from_pretrained (meta model, C reads each tensor's shards from
           the file, shards go straight to their devices)

Before timing, both loaded models are checked to hold identical weights.
Goal (issue 2): autoxla transient <= 2x the largest tensor; naive >= 1x the model.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS (Linux >= 4.0).
    with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
        f.write("5")


def make_checkpoint(directory: Path, size_gb: float) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers = 2048, max(1, round(8 * size_gb))
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=5632,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                         dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
    model.save_pretrained(directory, max_shard_size="200MB")
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return {"model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes)}


def measured_load(load) -> tuple:
    """Runs ``load()`` on 8 XLA:CPU devices (SPMD), with the runtime already up: (the model, a
    dict of seconds, rss_before, peak, rss_after). rss_after is taken after malloc_trim, so freed
    heap is not counted as kept (without it a dropped CPU copy of the model would hide)."""
    from AutoXLA import backend

    backend.use_cpu_devices(8)
    backend.ensure_spmd()
    import transformers

    transformers.logging.set_verbosity_error()
    backend.device()
    backend.sync()
    before = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    model = load()
    backend.sync()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return model, {"seconds": seconds, "rss_before": before, "peak": peak,
                   "rss_after": _status("VmRSS")}


def naive_load(path: str, strategy: str, scan_layers: bool = True):
    """transformers.from_pretrained on the CPU, .to(xla), then mark_sharding per AutoXLA's plan."""
    import torch
    from transformers import AutoModelForCausalLM

    from AutoXLA import backend
    from AutoXLA.modeling.from_config import plan_from_config

    plan = plan_from_config(path, strategy, backend.device_count(), scan_layers=scan_layers)
    mesh = backend.make_mesh(plan.mesh)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(backend.device())
    for name, p in model.named_parameters():
        backend.mark_sharding(p, mesh, plan[name].spec)
    return model


def _child(path: str, mode: str) -> None:
    """Runs in a fresh process: load one way, print a JSON line with the measurements."""
    sys.path.insert(0, str(ROOT))
    import torch

    def load():
        if mode == "autoxla":
            from AutoXLA.modeling import AutoXLAModelForCausalLM

            return AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="fsdp")
        return naive_load(path, "fsdp")

    model, m = measured_load(load)
    # A checksum of every parameter, to check both paths loaded the same weights.
    with torch.no_grad():
        checksum = sum(float(p.float().abs().sum().cpu()) for p in model.parameters())
    print(json.dumps({"mode": mode, **m,
                      "model_on_devices": sum(p.numel() * p.element_size() for p in model.parameters()),
                      "transient": m["peak"] - m["rss_after"], "checksum": checksum}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(*args.child)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "ckpt"
        info = make_checkpoint(path, args.size_gb)
        results = {}
        for mode in ("naive", "autoxla"):
            out = subprocess.run([sys.executable, __file__, "--child", str(path), mode],
                                 capture_output=True, text=True, check=False)
            if out.returncode:
                sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    if abs(results["naive"]["checksum"] - results["autoxla"]["checksum"]) > 1e-6 * abs(results["naive"]["checksum"]):
        sys.exit(f"the two paths loaded different weights: {results}")
    mb = 2 ** 20
    model, largest = info["model_bytes"], info["largest_tensor_bytes"]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}")
    print(f"checkpoint: bf16 Llama, {model / mb:.0f} MiB, largest tensor {largest / mb:.0f} MiB; "
          "fsdp over 8 XLA:CPU devices")
    for mode in ("naive", "autoxla"):
        r = results[mode]
        print(f"{mode:8s} time {r['seconds']:6.2f} s   transient {r['transient'] / mb:7.0f} MiB "
              f"= {r['transient'] / largest:5.2f}x largest tensor = {r['transient'] / model:4.2f}x model"
              f"   (peak - before - model: {(r['peak'] - r['rss_before'] - model) / mb:.0f} MiB)")
    n, a = results["naive"], results["autoxla"]
    print(f"ratio naive/autoxla: time {n['seconds'] / a['seconds']:.2f}x, "
          f"transient memory {n['transient'] / max(a['transient'], 1):.1f}x")
    ours_ok = a["transient"] <= 2 * largest
    print(f"goal autoxla transient <= 2x largest tensor: {'met' if ours_ok else 'NOT met'} "
          f"({a['transient'] / largest:.2f}x)")
    print(f"expectation naive transient >= 1x model: {'seen' if n['transient'] >= model else 'not seen'} "
          f"({n['transient'] / model:.2f}x)")


if __name__ == "__main__":
    main()
