"""What one host of a multi-host slice reads of a 7B-shaped decoder layer, and how long it takes,
against reading every tensor whole: the reading half of per-host loading (docs/multihost.md).

    ./run python bench/host_read.py [--hosts 2 4 8 16] [--repeat 3] [--dir DIR]

The layer (Llama-2-7B's shapes, bf16, 386 MiB) is written once as a safetensors file. Each host
owns 4 chips, as on v4/v5p/v5e/v6e multi-host slices; the mesh is fsdp over all 4 x P chips, the
strategy that splits every weight over every host. For host 0 of P, in one run, side by side:

  whole:   every tensor read whole and cut into every device's shard (what one process does, and
           what each host would do without per-host loading)
  gap 0:   only its shards' bytes (the loader's setting, loading/streaming.READ_GAP_BYTES)
  gap 4K:  ranges up to a page apart merged into one pread

Reported: MiB read, seconds (best of --repeat, page cache warm: this measures the CPU side, preads
and conversion, not the disk or network), and the ratio to whole. The column-split weights
(q, k, v, gate, up under fsdp's ("model", "fsdp") rule) leave one range per row per host.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from AutoXLA import _native  # noqa: E402
from AutoXLA.loading import checkpoint as ckpt  # noqa: E402
from AutoXLA.loading import streaming  # noqa: E402
from AutoXLA.sharding import hosts, rules  # noqa: E402
from AutoXLA.sharding.hosts import Host  # noqa: E402
from AutoXLA.sharding.mesh import AXES, mesh_shape_for  # noqa: E402

CHIPS_PER_HOST = 4
LAYER = {   # Llama-2-7B, one decoder layer: name -> (shape, module name for the rule)
    "q_proj": ((4096, 4096), "q_proj"), "k_proj": ((4096, 4096), "k_proj"),
    "v_proj": ((4096, 4096), "v_proj"), "o_proj": ((4096, 4096), "o_proj"),
    "gate_proj": ((11008, 4096), "gate_proj"), "up_proj": ((11008, 4096), "up_proj"),
    "down_proj": ((4096, 11008), "down_proj"),
}


def _layer_file(directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "layer.safetensors"
    if not path.exists():
        g = torch.Generator().manual_seed(0)
        save_file({n: torch.randn(s, generator=g, dtype=torch.float32).to(torch.bfloat16)
                   for n, (s, _) in LAYER.items()}, str(path))
    return path


def _specs(hosts: int):
    shape = mesh_shape_for("fsdp", hosts * CHIPS_PER_HOST)
    mesh = types.SimpleNamespace(axis_names=AXES, mesh_shape=shape.sizes,
                                 device_ids=np.arange(shape.num_devices))
    specs = {}
    for name, (dims, module) in LAYER.items():
        rule = rules._linear_rule("weight", module, False, None)
        specs[name], _ = rules.resolve_spec(rule, dims, shape)
    return mesh, specs


def _time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="autoxla-host-read-"))
    records = ckpt.read_safetensors_header(_layer_file(directory))
    total = sum(r.nbytes for r in records.values())
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}; one 7B decoder layer, {total / 2**20:.0f} MiB bf16")
    print(f"{'hosts':>5} {'chips':>5} | {'whole MiB':>9} {'s':>6} | {'gap0 MiB':>8} {'s':>6} "
          f"{'x whole':>7} | {'gap4K MiB':>9} {'s':>6} {'x whole':>7} | preads gap0")
    for count in args.hosts:
        mesh, specs = _specs(count)
        host = Host.simulated_host(0, count, count * CHIPS_PER_HOST)

        def read(gap):
            n = 0
            for name, record in records.items():
                _, got = streaming.host_shards(record, specs[name], mesh, host, torch.bfloat16,
                                               gap_bytes=gap)
                n += got
            return n

        def whole():       # every tensor read whole and cut into all its shards
            everything = Host.single(count * CHIPS_PER_HOST)
            for name, record in records.items():
                streaming.host_shards(record, specs[name], mesh, everything, torch.bfloat16)

        read(0)     # page cache warm for every path
        t_whole = _time(whole, args.repeat)
        t0, t4 = _time(lambda: read(0), args.repeat), _time(lambda: read(4096), args.repeat)
        b0, b4 = read(0), read(4096)
        preads = sum(len(_native.block_ranges(
            r.dtype, r.shape, hosts.shard_grid(specs[n], mesh), hosts.host_blocks(specs[n], mesh,
                                                                                 host)))
            for n, r in records.items())
        print(f"{count:>5} {count * CHIPS_PER_HOST:>5} | {total / 2**20:>9.1f} {t_whole:>6.3f} | "
              f"{b0 / 2**20:>8.1f} {t0:>6.3f} {t0 / t_whole:>7.2f} | {b4 / 2**20:>9.1f} "
              f"{t4:>6.3f} {t4 / t_whole:>7.2f} | {preads}")


if __name__ == "__main__":
    main()
