"""Attention on XLA:CPU: the portable blockwise path vs transformers' eager attention.

    ./run python bench/attention.py [--seq 512,2048,4096] [--repeats N] [--dtype fp32|bf16]

One XLA:CPU device (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=1, no SPMD), so this measures the attention
itself. Shapes: B=1, 8 query heads, 2 kv heads, head dim 64; for each sequence length, a causal
mask and a causal sliding window of 1024. Contenders, in one run, on the same inputs:

  eager      transformers' own ``eager_attention_forward`` (Llama): repeat kv heads, q @ k^T *
             scale, + an additive float mask (finfo.min where masked, 0 where allowed), softmax
             in float32, @ v, transposed to [B, S, H, D]. The mask is built once per shape and
             put on the device before timing, as transformers builds it once per forward and
             shares it across layers.
  blockwise  ``AutoXLA.attention.blockwise.blockwise_attention(..., causal=True, window=None or
             1024, block_q=512, block_kv=512)``, transposed to [B, S, H, D] the same way.

Correctness comes first: the first call of each path (which traces and compiles) is checked
against the other on that exact shape, max abs diff printed, failing if > 1e-3 (fp32; 3e-2 bf16).
The first call is timed on its own (compile time from torch_xla's CompileTime metric). Then the
two paths are timed alternately (drift hits both alike), each call traced, run with
torch_xla.sync() and waited for with xm.wait_device_ops(); the median is reported, and how much
of it is Python tracing of the lazy graph. Peak memory is the growth of the process's peak RSS
over one extra call after malloc_trim, the largest of three (XLA:CPU buffers live in host RAM;
an approximation of each program's working set, not an allocator statistic).
"""

from __future__ import annotations

import os

# Before torch_xla is imported: one CPU device, no SPMD (./run exports CPU_NUM_DEVICES=8).
os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "1"
os.environ.pop("XLA_USE_SPMD", None)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
import transformers  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

from AutoXLA import backend  # noqa: E402
from AutoXLA.attention.blockwise import blockwise_attention, schedule  # noqa: E402

B, HQ, HKV, D = 1, 8, 2, 64
WINDOW, BLOCK = 1024, 512
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {"fp32": 1e-3, "bf16": 3e-2}


def additive_mask(s: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """transformers' eager mask: [1, 1, S, S], 0 where allowed, finfo.min where masked."""
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    mask = torch.zeros(s, s, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    # Give freed heap back first, or one path would reuse pages the other left resident.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # resets VmHWM to the current RSS


def _compile_ns() -> float:
    data = met.metric_data("CompileTime")
    return float(data[1]) if data else 0.0


def _call(fn) -> tuple[torch.Tensor, float, float]:
    """Runs fn() to completion on the device: (output, seconds tracing, seconds in all)."""
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    torch_xla.sync()
    xm.wait_device_ops()
    return out, t1 - t0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default="512,2048,4096", help="comma-separated sequence lengths")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed calls per path (default: 15 up to 2048, 7 above)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    seqs = [int(s) for s in args.seq.split(",")]

    t_start = time.perf_counter()
    dev = torch_xla.device()
    assert not xr.is_spmd() and xr.global_runtime_device_count() == 1
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"machine: {platform.machine()} {cpu}, {os.cpu_count()} CPUs; Python "
          f"{platform.python_version()}, torch {torch.__version__}, "
          f"torch_xla {torch_xla.__version__}, transformers {transformers.__version__}")
    print(f"device: {dev} ({xr.device_type()}), 1 device, no SPMD")
    print(f"command: {' '.join(['python', *sys.argv])}")
    print(f"shape: B={B}, {HQ} query heads, {HKV} kv heads, head dim {D}, {args.dtype}; "
          f"blockwise block_q = block_kv = {BLOCK}\n")

    module = SimpleNamespace(num_key_value_groups=HQ // HKV, training=False)
    scale = D ** -0.5
    rows = []
    for s in seqs:
        repeats = args.repeats or (15 if s <= 2048 else 7)
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(B, h, s, D, generator=g).to(dtype).to(dev)
                   for h in (HQ, HKV, HKV))
        for mask_name, window in (("causal", None), (f"window {WINDOW}", WINDOW)):
            mask = additive_mask(s, window, dtype).to(dev)
            torch_xla.sync()
            xm.wait_device_ops()

            def eager(mask=mask):
                return eager_attention_forward(module, q, k, v, mask, scale)[0]

            def blockwise(window=window):
                out = blockwise_attention(q, k, v, scale=scale, causal=True, window=window,
                                          block_q=BLOCK, block_kv=BLOCK)
                return out.transpose(1, 2).contiguous()

            paths = {"eager": eager, "blockwise": blockwise}
            first, compiles, outs = {}, {}, {}
            for name, fn in paths.items():      # first call: trace + compile + run
                c0, ns0 = backend.compile_count(), _compile_ns()
                outs[name], _, first[name] = _call(fn)
                compiles[name] = (backend.compile_count() - c0, (_compile_ns() - ns0) / 1e9)

            got = {name: out.cpu().float() for name, out in outs.items()}
            diff = (got["eager"] - got["blockwise"]).abs().max().item()
            print(f"S={s} {mask_name}: max |eager - blockwise| = {diff:.2e}")
            if not diff <= TOLERANCE[args.dtype]:
                sys.exit(f"FAIL: S={s} {mask_name}: eager and blockwise differ by {diff:.3e} "
                         f"(> {TOLERANCE[args.dtype]:g})")
            del outs, got

            times = {name: [] for name in paths}
            traces = {name: [] for name in paths}
            c0 = backend.compile_count()
            for _ in range(repeats):             # interleaved: each round times both once
                for name, fn in paths.items():
                    _, tr, tt = _call(fn)
                    times[name].append(tt)
                    traces[name].append(tr)
            recompiles = backend.compile_count() - c0
            if recompiles:
                print(f"  warning: {recompiles} compilations during the timed calls")

            peak = {name: 0 for name in paths}
            for _ in range(3):   # max of 3: a call sometimes reuses pages still resident
                for name, fn in paths.items():
                    _reset_peak()
                    before = _status("VmRSS")
                    out, _, _ = _call(fn)
                    peak[name] = max(peak[name], _status("VmHWM") - before)
                    del out

            plan = schedule(s, s, BLOCK, BLOCK, causal=True, window=window)
            med = {name: statistics.median(t) for name, t in times.items()}
            row = dict(seq=s, mask=mask_name, repeats=repeats, diff=diff, plan=plan, med=med,
                       trace={n: statistics.median(t) for n, t in traces.items()},
                       spread={n: (min(t), max(t)) for n, t in times.items()},
                       first=first, compiles=compiles, peak=peak)
            rows.append(row)
            print(f"  eager {med['eager'] * 1e3:.1f} ms, blockwise {med['blockwise'] * 1e3:.1f} ms "
                  f"(median of {repeats}); first calls {first['eager']:.2f} s / "
                  f"{first['blockwise']:.2f} s")

    mib = 2 ** 20
    print(f"\n{args.dtype}, median ms per call (traced + run + waited); ratio = eager / blockwise "
          "(> 1: blockwise faster); skipped = fraction of 512x512 blocks the schedule never "
          "builds; flop ratio = 1 / (1 - skipped), what skipping alone predicts")
    print("| seq | mask | eager ms | blockwise ms | ratio | skipped | flop ratio "
          "| tracing ms (e / b) | peak RSS growth MiB (e / b) | repeats |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, p, tr = r["med"], r["plan"], r["trace"]
        print(f"| {r['seq']} | {r['mask']} | {m['eager'] * 1e3:.1f} | {m['blockwise'] * 1e3:.1f} "
              f"| {m['eager'] / m['blockwise']:.2f}x | {p.skipped_fraction:.1%} "
              f"({p.computed}/{p.q_blocks * p.kv_blocks}) | {1 / (1 - p.skipped_fraction):.2f}x "
              f"| {tr['eager'] * 1e3:.1f} / {tr['blockwise'] * 1e3:.1f} "
              f"| {r['peak']['eager'] / mib:.0f} / {r['peak']['blockwise'] / mib:.0f} "
              f"| {r['repeats']} |")
    print("\nfirst call of each path (trace + XLA compile + run); compilations in brackets:")
    print("| seq | mask | eager first call s | eager compile s | blockwise first call s "
          "| blockwise compile s | min-max ms (e / b) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        f, c, sp = r["first"], r["compiles"], r["spread"]
        print(f"| {r['seq']} | {r['mask']} | {f['eager']:.2f} | {c['eager'][1]:.2f} "
              f"({c['eager'][0]}) | {f['blockwise']:.2f} | {c['blockwise'][1]:.2f} "
              f"({c['blockwise'][0]}) | {sp['eager'][0] * 1e3:.0f}-{sp['eager'][1] * 1e3:.0f} / "
              f"{sp['blockwise'][0] * 1e3:.0f}-{sp['blockwise'][1] * 1e3:.0f} |")
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
