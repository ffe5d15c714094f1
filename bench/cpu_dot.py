"""Why SmolLM2's decode on 1 XLA:CPU device is slower than transformers' eager loop at batch 8
and 32 but not at batch 1: XLA:CPU's matrix multiply at a few rows, measured alone.

One process, 1 virtual XLA:CPU device, fp32: a chain of SmolLM2-135M's MLP shapes (x[M, 576]
times 60 distinct [1536, 576] weights and back through 60 [576, 1536] ones, 424 MB of weights,
so they stream from memory as in a decode step) on XLA:CPU and with PyTorch's CPU kernels on the
same thread budget, at M = 1, 8 and 32 rows (the decode batch). Prints ms per layer (one up and
one down projection) and the ratio. No AutoXLA code runs: this is the backend alone.

    CPU_NUM_DEVICES=1 ./run python bench/cpu_dot.py [--rows 1 8 32] [--layers 60]

Measured (docs/benchmarks.md): at M = 1 XLA:CPU emits a matrix-vector loop and matches PyTorch; at
M >= 2 it calls Eigen's GEMM, which repacks the whole weight on every call (perf: about 58 % of a
batch-8 SmolLM2 decode step in Eigen's gemm_pack_colmajor_block), about 5x PyTorch's time at 8 rows.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def chain(x, ups, downs):
    import torch

    for up, down in zip(ups, downs):
        x = torch.nn.functional.linear(torch.nn.functional.linear(x, up), down) * 0.01
    return x


def per_layer_ms(run, layers: int, repeats: int) -> float:
    run()                                               # compile (XLA) or warm caches
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - t0) / repeats / layers * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    import torch

    from AutoXLA import backend

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    ups = [torch.randn(1536, 576) for _ in range(a.layers)]
    downs = [torch.randn(576, 1536) for _ in range(a.layers)]
    dev = backend.device()
    ups_x, downs_x = [w.to(dev) for w in ups], [w.to(dev) for w in downs]
    backend.sync()
    print(f"{os.cpu_count()} cores, {backend.device_count()} XLA:CPU device(s), fp32, "
          f"{a.layers} layers of [1536, 576] up + [576, 1536] down")
    print(f"{'rows':>4} {'XLA:CPU ms/layer':>17} {'PyTorch CPU ms/layer':>21} {'XLA/PyTorch':>12}")
    for rows in a.rows:
        x = torch.randn(rows, 576)
        x_dev = x.to(dev)

        def on_xla():
            out = chain(x_dev, ups_x, downs_x)
            backend.sync()
            backend.wait_for_transfers()
            return out

        xla_ms = per_layer_ms(on_xla, a.layers, a.repeats)
        cpu_ms = per_layer_ms(lambda: chain(x, ups, downs), a.layers, a.repeats)
        print(f"{rows:>4} {xla_ms:>17.3f} {cpu_ms:>21.3f} {xla_ms / cpu_ms:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
