"""Quantizing bf16 weights: the C engine vs a pure-torch quantizer vs a plain memory copy.

    PYTHONPATH=$PWD python bench/quantize.py [--repeats 7] [--torch-repeats 2] [--threads 1,0]

Shapes 8192x8192 and 4096x14336, bf16, N(0, 0.02). Contenders, all in one run, each at the
same thread count (1, then all CPUs):
  copy     the C core's own copy path: _native.convert bf16 -> bf16 (axl_convert with equal
           dtypes = memcpy, split over the same threads) into a preallocated buffer
  C        _native.quantize: int8 per-channel symmetric, and int4 in blocks of 64 asymmetric;
           scales stored as float32 and as bfloat16 (scale_dtype, the product's setting);
           with error statistics off and on; into preallocated out= buffers
  torch    tests/reference_quant.quantize_reference: the same arithmetic in vectorised torch
           ops (torch.set_num_threads(n)), no statistics, with the same scale dtype
Correctness comes first: on the first 256 rows of each shape, the C engine must equal the torch
reference (q, scales, zero points) and its statistics the float64 ones, for both scale dtypes.
Then every contender is timed, best of several repeats, interleaved so that drift hits all
alike.

GB/s counts bytes read + bytes written: the weight read; q, scales (+ zero points) (+ max_err
and sqnr_db) written; the copy reads and writes the weight's bytes. Goals: C >= 70% of the
copy's GB/s at the same thread count, and >= 10x the torch quantizer's (same scale dtype).

Then the error-minimising search (issue 14; _native.quantize(..., search=True)) beside the
plain absmax / min-max path on one shape (--search-shape, default 4096x4096 bf16), in the
llama.cpp-like formats int4 block-32 symmetric (Q4_0), int4 block-32 offset (Q4_1) and int8
block-32 symmetric (Q8_0), bf16 scales, per thread and on all threads, with the mean squared
error of each against the float weight. Goal: the search >= 1 GB/s per thread (same GB/s).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from AutoXLA import _native  # noqa: E402
from tests.reference_quant import (  # noqa: E402
    dequantize_reference,
    error_stats_reference,
    quantize_reference,
)

SHAPES = [(8192, 8192), (4096, 14336)]
SEARCH_FORMATS = [  # label, quantize() keywords
    ("int4 block-32 sym (Q4_0-like)", dict(bits=4, symmetric=True, block_size=32)),
    ("int4 block-32 offset (Q4_1-like)", dict(bits=4, symmetric=False, offset=True, block_size=32)),
    ("int8 block-32 sym (Q8_0-like)", dict(bits=8, symmetric=True, block_size=32)),
]
SEARCH_GOAL = 1.0  # GB/s per thread with the search on
FORMATS = [  # label, bits, symmetric, block_size
    ("int8 per-channel sym", 8, True, -1),
    ("int4 block-64 asym", 4, False, 64),
]
SCALE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}  # label -> scale dtype
COPY_GOAL, TORCH_GOAL = 0.70, 10.0
CHECK_ROWS = 256


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _out_buffers(rows: int, cols: int, bits: int, symmetric: bool, block_size: int, stats: bool,
                 scale_dtype: torch.dtype):
    block = cols if block_size == -1 else block_size
    g = cols // block
    return _native.Quantized(
        torch.empty(_native.quantized_shape(rows, cols, bits),
                    dtype=torch.int8 if bits == 8 else torch.uint8),
        torch.empty(rows, g, dtype=scale_dtype),
        None if symmetric else torch.empty(rows, g, dtype=torch.int8),
        torch.empty(rows) if stats else None,
        torch.empty(rows) if stats else None,
    )


def _written_bytes(out: _native.Quantized) -> int:
    return sum(t.numel() * t.element_size() for t in out if t is not None)


def check(w: torch.Tensor, bits: int, symmetric: bool, block_size: int,
          scale_dtype: torch.dtype) -> None:
    """The C engine equals the torch reference on a slice; its statistics match float64."""
    part = w[:CHECK_ROWS].contiguous()
    got = _native.quantize(part, bits=bits, symmetric=symmetric, block_size=block_size, stats=True,
                           scale_dtype=scale_dtype)
    q, scale, zp = quantize_reference(part, bits, symmetric, block_size, scale_dtype)
    same = torch.equal(got.q, q) and torch.equal(got.scale, scale)
    same &= symmetric or torch.equal(got.zero_point, zp)
    dq = dequantize_reference(q, scale, zp, bits, part.shape[1], block_size)
    max_err, sqnr = error_stats_reference(part, dq)
    same &= torch.equal(got.max_err, max_err)
    same &= torch.allclose(got.sqnr_db, sqnr, rtol=1e-6, atol=1e-5)
    if not same:
        sys.exit(f"C engine != torch reference for int{bits} sym={symmetric} block {block_size} "
                 f"{scale_dtype} scales")


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        cc = "?"
    return (f"{platform.machine()} {cpu}, {_native.num_cpus()} CPUs, ISA {_native.best_isa()}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, {cc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of copy and C (best kept)")
    ap.add_argument("--torch-repeats", type=int, default=2, help="timed runs of the torch quantizer")
    ap.add_argument("--threads", default="1,0", help="comma-separated thread counts (0 = all CPUs)")
    ap.add_argument("--search-shape", default="4096x4096", help="rows x cols of the search section")
    ap.add_argument("--only-search", action="store_true", help="run the search section alone")
    args = ap.parse_args()
    search_shape = tuple(int(v) for v in args.search_shape.split("x"))
    thread_counts = [int(t) for t in args.threads.split(",")]
    torch_threads_before = torch.get_num_threads()

    print(f"machine: {machine()}")
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print("copy = _native.convert bf16 -> bf16 (the C core's memcpy path, same thread count)")
    print("GB/s = (bytes read + bytes written) / best time\n")
    verdicts = []
    for rows, cols in [] if args.only_search else SHAPES:
        w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
        for _, bits, symmetric, block_size in FORMATS:
            for scale_dtype in SCALE_DTYPES.values():
                check(w, bits, symmetric, block_size, scale_dtype)
        w_bytes = w.numel() * w.element_size()
        for nthreads in thread_counts:
            n = nthreads or _native.num_cpus()
            torch.set_num_threads(n)
            copy_buf = torch.empty_like(w)
            # key: (format, scale dtype label, stats)
            outs = {(f, sd, st): _out_buffers(rows, cols, f[1], f[2], f[3], st, SCALE_DTYPES[sd])
                    for f in FORMATS for sd in SCALE_DTYPES for st in (False, True)}

            def run_copy():
                _native.convert(w, torch.bfloat16, out=copy_buf, nthreads=nthreads)

            def run_c(fmt, sd, stats):
                _, bits, symmetric, block_size = fmt
                _native.quantize(w, bits=bits, symmetric=symmetric, block_size=block_size,
                                 stats=stats, scale_dtype=SCALE_DTYPES[sd], nthreads=nthreads,
                                 out=outs[(fmt, sd, stats)])

            # Interleaved repeats: each round times every contender once.
            times = {"copy": float("inf")}
            times.update({key: float("inf") for key in outs})
            run_copy()
            for key in outs:
                run_c(*key)  # warm-up: page in the output buffers
            for _ in range(args.repeats):
                times["copy"] = min(times["copy"], _best(run_copy, 1))
                for key in outs:
                    times[key] = min(times[key], _best(lambda: run_c(*key), 1))
            torch_times = {
                (fmt, sd): _best(lambda: quantize_reference(w, fmt[1], fmt[2], fmt[3], dt),
                                 args.torch_repeats)
                for fmt in FORMATS for sd, dt in SCALE_DTYPES.items()
            }

            copy_gbs = 2 * w_bytes / times["copy"] / 1e9
            print(f"{rows}x{cols} bf16, {n} thread{'s' if n > 1 else ''}:")
            print(f"  {'copy (axl_convert bf16->bf16)':44s} {times['copy'] * 1e3:8.2f} ms "
                  f"{copy_gbs:7.1f} GB/s")
            for fmt in FORMATS:
                label = fmt[0]
                for sd in SCALE_DTYPES:
                    out_bytes = _written_bytes(outs[(fmt, sd, False)])
                    t_torch = torch_times[(fmt, sd)]
                    torch_gbs = (w_bytes + out_bytes) / t_torch / 1e9
                    print(f"  {f'torch reference, {label}, {sd} scales':44s} {t_torch * 1e3:8.2f} ms "
                          f"{torch_gbs:7.1f} GB/s")
                    for stats in (False, True):
                        t = times[(fmt, sd, stats)]
                        gbs = (w_bytes + _written_bytes(outs[(fmt, sd, stats)])) / t / 1e9
                        vs_copy, vs_torch = gbs / copy_gbs, t_torch / t
                        name = f"C {label}, {sd} scales, stats {'on' if stats else 'off'}"
                        print(f"  {name:44s} {t * 1e3:8.2f} ms {gbs:7.1f} GB/s   C/copy "
                              f"{vs_copy:5.2f}   C/torch {vs_torch:6.1f}x")
                        verdicts.append((f"{rows}x{cols} {n}t {label} {sd} stats "
                                         f"{'on' if stats else 'off'}", vs_copy, vs_torch))
            print()
    torch.set_num_threads(torch_threads_before)

    if verdicts:
        print(f"goals: C >= {COPY_GOAL:.0%} of copy GB/s at equal threads, C >= "
              f"{TORCH_GOAL:.0f}x torch")
    for name, vs_copy, vs_torch in verdicts:
        ok_copy, ok_torch = vs_copy >= COPY_GOAL, vs_torch >= TORCH_GOAL
        print(f"  {name:53s} copy {'met' if ok_copy else 'NOT met':7s} ({vs_copy:6.1%})   "
              f"torch {'met' if ok_torch else 'NOT met':7s} ({vs_torch:5.1f}x)")
    print()
    search_section(search_shape, thread_counts, max(2, args.repeats // 2))


def search_section(shape: tuple[int, int], thread_counts: list[int], repeats: int) -> None:
    """The search beside the plain path: GB/s (read + written) and the error it buys."""
    rows, cols = shape
    w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    w_bytes = w.numel() * w.element_size()
    print(f"search: {rows}x{cols} bf16, bf16 scales; GB/s = (bytes read + written) / best time")
    verdicts = []
    for label, kw in SEARCH_FORMATS:
        kw = dict(kw, scale_dtype=torch.bfloat16)
        errors = {}
        for search in (False, True):
            r = _native.quantize(w, search=search, **kw)
            y = _native.dequantize(r.q, r.scale, r.zero_point, bits=kw["bits"], cols=cols,
                                   block_size=kw["block_size"], offset=r.offset)
            errors[search] = float((w.double() - y.double()).pow(2).mean())
            out_bytes = sum(t.numel() * t.element_size() for t in r if t is not None)
        for nthreads in thread_counts:
            n = nthreads or _native.num_cpus()
            times = {False: float("inf"), True: float("inf")}
            for _ in range(repeats):  # interleaved
                for search in (False, True):
                    times[search] = min(times[search], _best(
                        lambda: _native.quantize(w, search=search, nthreads=nthreads, **kw), 1))
            gbs = {k: (w_bytes + out_bytes) / t / 1e9 for k, t in times.items()}
            print(f"  {label:34s} {n} thread{'s' if n > 1 else ' '}: plain {gbs[False]:6.2f} GB/s, "
                  f"search {gbs[True]:6.2f} GB/s ({gbs[True] / n:5.2f} per thread, "
                  f"{times[True] / times[False]:5.1f}x the time); MSE plain {errors[False]:.4g}, "
                  f"search {errors[True]:.4g} ({errors[True] / errors[False]:.3f}x)")
            verdicts.append((f"{label} {n}t", gbs[True] / n))
    print(f"goal: search >= {SEARCH_GOAL:.1f} GB/s per thread")
    for name, per_thread in verdicts:
        ok = per_thread >= SEARCH_GOAL
        print(f"  {name:40s} {'met' if ok else 'NOT met':7s} ({per_thread:.2f} GB/s per thread"
              f"{'' if ok else f', {SEARCH_GOAL / per_thread:.1f}x short'})")


if __name__ == "__main__":
    main()
