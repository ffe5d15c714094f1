"""Mixture-of-experts dispatch on 8 XLA:CPU devices (fsdp, experts split by expert): AutoXLA's
dense dispatch (every expert on every token, weighted by the router's top-k) against
transformers' "batched_mm" (one gathered weight matrix per token and choice), the only other
experts forward of transformers with static shapes.

    ./run python bench/moe_dispatch.py [--hidden 512] [--inter 1024] [--experts 8] [--top-k 2]

One Mixtral experts module, fp32. For each token count: both outputs are first checked equal to
transformers' eager forward on the CPU, then each is timed (median of 5 runs after a compiling
one) and its compiled programs counted. What "batched_mm" must hold at once, tokens x top-k
weight matrices, is printed; where it exceeds --limit-gb it is not run.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", default="8,64,512")
    ap.add_argument("--limit-gb", type=float, default=4.0)
    args = ap.parse_args()

    from AutoXLA import backend

    backend.use_cpu_devices(8)
    backend.ensure_spmd()
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from AutoXLA import moe as ours
    from AutoXLA.sharding.mesh import MeshShape

    ours.register()
    dev = backend.device()
    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.inter,
                           num_local_experts=args.experts, num_experts_per_tok=args.top_k)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    module = MixtralExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.05)
    mesh = backend.make_mesh(MeshShape(1, 8, 1))
    backend.set_global_mesh(mesh)
    on_xla = MixtralExperts(config).to(dev)
    with torch.no_grad():
        for name, p in module.named_parameters():
            getattr(on_xla, name).copy_(p.to(dev))
            backend.mark_sharding(getattr(on_xla, name), mesh, ("fsdp", None, None))
    on_xla.autoxla_dispatch_spec = (None, "fsdp", None)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}")
    print(f"experts: {args.experts} x (gate_up {2 * args.inter}x{args.hidden}, down "
          f"{args.hidden}x{args.inter}) fp32, top-{args.top_k}; fsdp over 8 XLA:CPU devices, "
          "experts split by expert")
    print(f"{'tokens':>7} {'dispatch':>15} {'ms/call':>9} {'programs':>9}  note")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, args.hidden)
        logits = torch.randn(tokens, args.experts)
        weights, index = torch.softmax(logits, -1).topk(args.top_k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        with torch.no_grad():
            want = module(x, index, weights)
        gathered = tokens * args.top_k * 3 * args.inter * args.hidden * 4
        for name in ("autoxla_experts", "batched_mm"):
            if name == "batched_mm" and gathered > args.limit_gb * 2**30:
                print(f"{tokens:>7} {name:>15} {'-':>9} {'-':>9}  not run: holds "
                      f"{gathered / 2**30:.1f} GiB of gathered expert weights")
                continue
            on_xla.config._experts_implementation = name
            xs, ws, ids = x.to(dev), weights.to(dev), index.to(dev)
            with torch.no_grad():
                before = backend.compile_count()
                got = on_xla(xs, ids, ws).cpu()
                err = (got - want).abs().max().item() / want.abs().max().item()
                if err > 1e-5:
                    sys.exit(f"{name} at {tokens} tokens differs from transformers' eager "
                             f"forward by {err:.2e} (relative to the largest output)")
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    on_xla(xs, ids, ws).cpu()
                    times.append(time.perf_counter() - t0)
                programs = backend.compile_count() - before
            print(f"{tokens:>7} {name:>15} {statistics.median(times) * 1e3:9.2f} {programs:>9}  "
                  f"equal to eager within {err:.1e}")


if __name__ == "__main__":
    main()
