"""Loading a Mixtral-shaped hub-layout checkpoint (one tensor per expert, >= 2 GB bf16) sharded
over 8 XLA:CPU devices (2d): AutoXLA vs transformers + .to(xla).

    ./run python bench/moe_load.py [--size-gb 2.2] [--dir DIR]

transformers 5 fuses the per-expert tensors into one [experts, ...] parameter per projection as
it loads; AutoXLA assembles each device's shard of that parameter from the per-expert tensors
(loading/converted.py). Each path runs in a fresh process, one after the other; both loaded
models are checked to hold the same weights before anything is reported.

Reported per path: wall time, and peak RSS minus the RSS before loading (the runtime is already
up then), against the goal: the loaded model (XLA:CPU keeps device buffers in host memory) plus
2 of its largest tensors.

  naive:   AutoModelForCausalLM.from_pretrained on the CPU, .to(xla), mark_sharding per the plan
  autoxla: AutoXLAModelForCausalLM.from_pretrained(sharding_strategy="2d")
  autoxla-int8: the same with do_quant=True, QuantizationConfig(bits=8): every expert's tensor
           quantized by the C engine as it streams (quantization/experts.py); its goal is the
           int8 model plus 2 of the largest bf16 tensors
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.child import run_json_child  # noqa: E402
from bench.load import measured_load, naive_load  # noqa: E402

STRATEGY = "2d"


def make_checkpoint(directory: Path, size_gb: float) -> dict:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    hidden, inter, experts = 1024, 3584, 8
    per_layer = 3 * experts * hidden * inter * 2 + 4 * hidden * hidden * 2
    layers = max(2, round(size_gb * 2**30 / per_layer))
    config = MixtralConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                           num_hidden_layers=layers, num_attention_heads=16,
                           num_key_value_heads=8, num_local_experts=experts,
                           num_experts_per_tok=2, dtype="bfloat16")
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
    model.save_pretrained(directory, max_shard_size="500MB")   # hub layout: per-expert tensors
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return {"model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "layers": layers}


def _child(path: str, mode: str) -> None:
    import torch

    def load():
        if mode.startswith("autoxla"):
            from AutoXLA.modeling import AutoXLAModelForCausalLM
            from AutoXLA.quantization import QuantizationConfig

            quant = dict(do_quant=True, quantization_config=QuantizationConfig(bits=8)) \
                if mode == "autoxla-int8" else {}
            return AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=STRATEGY,
                                                           scan_layers=False, **quant)
        return naive_load(path, STRATEGY, scan_layers=False)

    model, m = measured_load(load)
    if mode == "autoxla-int8":     # what it holds, and what the C engine measured
        from AutoXLA.quantization.experts import QuantizedExperts

        report = model.autoxla_quantization
        held = [*model.parameters(), *model.buffers()]
        print(json.dumps({"mode": mode, **m, "model_bytes": sum(t.nbytes for t in held),
                          "int8_experts": sum(isinstance(x, QuantizedExperts)
                                              and x.weight.dtype == torch.int8
                                              for x in model.modules()),
                          "worst_sqnr_db": min(d.min_sqnr_db for d in report.layers.values())}))
        return
    with torch.no_grad():
        sums = {n: float(p.float().abs().sum().cpu()) for n, p in model.named_parameters()}
    print(json.dumps({"mode": mode, **m, "sums": sums}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=2.2)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(*args.child)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "mixtral"
        info = make_checkpoint(path, args.size_gb)
        on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        results = {m: run_json_child([__file__, "--child", str(path), m], 3600)
                   for m in ("naive", "autoxla", "autoxla-int8")}
    for mode, r in results.items():
        if "error" in r:
            sys.exit(f"{mode}: {r['error']}")
    naive, ours = results["naive"]["sums"], results["autoxla"]["sums"]
    differ = [n for n in naive if abs(naive[n] - ours.get(n, float("nan"))) > 1e-6 * abs(naive[n])]
    if differ:
        sys.exit(f"the two paths loaded different weights: {differ[:5]}")
    mb = 2**20
    model, largest = info["model_bytes"], info["largest_tensor_bytes"]
    goal = model + 2 * largest
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}")
    print(f"checkpoint: Mixtral-shaped, {info['layers']} layers x 8 experts, bf16, hub layout "
          f"({on_disk / mb:.0f} MiB on disk, one tensor per expert); model {model / mb:.0f} MiB, "
          f"largest tensor {largest / mb:.0f} MiB (a fused gate_up_proj); {STRATEGY} over 8 "
          "XLA:CPU devices; weights equal in both paths")
    for mode in ("naive", "autoxla"):
        r = results[mode]
        grown = r["peak"] - r["rss_before"]
        print(f"{mode:8s} time {r['seconds']:6.2f} s   peak - before {grown / mb:7.0f} MiB = "
              f"model + {(grown - model) / largest:5.2f} x largest tensor")
    n, a = results["naive"], results["autoxla"]
    print(f"ratio naive/autoxla: time {n['seconds'] / a['seconds']:.2f}x, peak growth "
          f"{(n['peak'] - n['rss_before']) / (a['peak'] - a['rss_before']):.2f}x")
    met = a["peak"] - a["rss_before"] <= goal
    print(f"goal autoxla peak - before <= model + 2 x largest tensor ({goal / mb:.0f} MiB): "
          f"{'met' if met else 'NOT met'}")
    # do_quant: each expert's tensor is read in bf16 and quantized by the C engine as it streams.
    q = results["autoxla-int8"]
    if q["int8_experts"] != 2 * info["layers"]:
        sys.exit(f"autoxla-int8: {q['int8_experts']} int8 expert projections, expected "
                 f"{2 * info['layers']}")
    grown, qmodel = q["peak"] - q["rss_before"], q["model_bytes"]
    print(f"autoxla-int8 time {q['seconds']:6.2f} s   peak - before {grown / mb:7.0f} MiB = "
          f"int8 model ({qmodel / mb:.0f} MiB) + {(grown - qmodel) / largest:5.2f} x largest "
          f"bf16 tensor; worst weight row SQNR {q['worst_sqnr_db']:.1f} dB")
    print(f"goal autoxla-int8 peak - before <= int8 model + 2 x largest bf16 tensor "
          f"({(qmodel + 2 * largest) / mb:.0f} MiB): "
          f"{'met' if grown <= qmodel + 2 * largest else 'NOT met'}")


if __name__ == "__main__":
    main()
