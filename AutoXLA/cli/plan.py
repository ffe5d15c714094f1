"""`autoxla plan PATH_OR_HUB_ID`: the sharding plan from a config alone, and what it costs.

Reads top to bottom: flags checked (planning/request.py), the model built on meta and planned
(modeling/from_config.py), then whatever was asked of the plan: the KV cache, communication per
step, a memory forecast against a TPU slice, a ranking of meshes, a picture. Nothing here imports
torch_xla or needs a device.
"""
from __future__ import annotations

import dataclasses
import json
import sys

from ..attention import IMPLEMENTATIONS, AttentionConfig
from ..modeling.from_config import meta_model
from ..modeling.pipeline import plan_for_mesh
from ..planning import plot
from ..planning.adapters import plan_adapters
from ..planning import request as forecast_request
from ..planning.communication import communication
from ..planning.memory import OPTIMIZERS
from ..planning.plot import FORMATS
from ..quantization import QuantizationConfig
from ..sharding.mesh import mesh_shape_for, normalize_strategy
from ..sharding.multislice import MultiSlice


def add_arguments(p) -> None:
    p.add_argument("path", help="checkpoint directory, config.json, or hub id")
    p.add_argument("--strategy", default="fsdp", help="fsdp, dp, mp, 2d or 3d (default fsdp)")
    p.add_argument("--devices", type=int, default=None, help="number of devices (default 8, "
                   "or the --topology's chips)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the checkpoint's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--bits", type=int, default=None, help="plan int8 (8) or int4 (4) linears")
    p.add_argument("--block-size", type=int, default=None,
                   help="elements per scale (-1: per channel; default: 32 for int4, -1 for int8)")
    p.add_argument("--asym", action="store_true", help="asymmetric (zero points)")
    p.add_argument("--cpu", action="store_true", help="choose matmul backends as off a TPU")
    p.add_argument("--batch", type=int, default=None, help="with --max-len: plan the KV cache")
    p.add_argument("--max-len", type=int, default=None, help="KV cache length (slots)")
    p.add_argument("--comm", action="store_true", help="collectives per step: with --batch and "
                   "--seq a training step, with --batch and --max-len a decode step")
    p.add_argument("--seq", type=int, default=None, help="training sequence length (--comm, "
                   "--train)")
    p.add_argument("--no-scan", action="store_true", help="plan the decoder stack unrolled "
                   "(as from_pretrained(scan_layers=False))")
    p.add_argument("--train", action="store_true", help="forecast one training step's memory "
                   "per device (needs --batch and --seq)")
    p.add_argument("--infer", action="store_true", help="forecast generation's memory per device "
                   "(needs --batch and --max-len)")
    p.add_argument("--optimizer", default=None, help=f"with --train: {', '.join(OPTIMIZERS)} "
                   "(default adamw; sgdm is SGD with momentum)")
    p.add_argument("--grad-ckpt", action="store_true", help="with --train: checkpoint each "
                   "layer of an unrolled stack (a scanned one always is)")
    p.add_argument("--scan", action="store_true", help="plan the decoder stack scanned (the "
                   "default; --no-scan for unrolled)")
    p.add_argument("--attention", default="eager", help="the attention kernel to plan: eager, "
                   "xla_flash_attention or splash_attention (default eager)")
    p.add_argument("--attention-layers", default=None, metavar="I,J,...", help="with --attention: "
                   "the decoder layers that run it (attention_config['layers']; default all)")
    p.add_argument("--topology", default=None, help="a Cloud TPU slice, e.g. v5p-128, v5e-8, "
                   "v6e-256: sets --devices, compares the forecast with its HBM")
    p.add_argument("--headroom", type=float, default=forecast_request.DEFAULT_HEADROOM,
                   help="fraction of HBM kept free for what is not forecast (default "
                        f"{forecast_request.DEFAULT_HEADROOM})")
    p.add_argument("--recommend", action="store_true", help="with --topology: rank strategies "
                   "and mesh shapes by fit and bytes per device")
    p.add_argument("--slices", type=int, default=1, help="TPU slices joined by DCN (default 1): "
                   "the plan says which mesh axis crosses which link (docs/multihost.md)")
    p.add_argument("--dcn-axes", default="data", help="with --slices: the axes that may cross "
                   "DCN, comma-separated, in order (default data; data,fsdp)")
    p.add_argument("--lora-rank", type=int, default=None, metavar="R", help="plan LoRA adapters "
                   "of rank R on every decoder-layer projection (the decoder stack unrolled, as "
                   "fine-tuning loads it); with --train the base is frozen: gradients and "
                   "optimizer states of the adapters only. --bits N for a quantized base (QLoRA)")
    p.add_argument("--plot", default=None, metavar="FILE", help="draw memory per device by "
                   "category against the chip's HBM: the chosen strategy, or with --recommend "
                   f"every ranked mesh side by side ({', '.join('.' + f for f in FORMATS)})")


def run(args) -> int:
    qcfg = _quantization(args)
    attention, attention_config = _attention(args)
    req = forecast_request.request(args)       # every flag checked before a model is built
    strategy = normalize_strategy(args.strategy)
    slices = _multislice(args, mesh_shape_for(strategy, req.devices))

    def planned(s, m, slices=None):      # the plan, with the adapters asked for
        plan = plan_for_mesh(r, config, s, m, req.scan, attention, attention_config, slices)
        if req.lora_rank is None:
            return plan
        return dataclasses.replace(plan, adapters=plan_adapters(plan, req.lora_rank))

    with forecast_request.one_thread():
        r, config = meta_model(args.path, args.dtype, qcfg, on_tpu=not args.cpu)
        plan = planned(strategy, mesh_shape_for(strategy, req.devices), slices)
    kv = _kv_cache(plan, args, req)
    comm = _communication(plan, args)
    fc = forecast_request.forecast(req, plan, config)
    ranking = forecast_request.recommend(req, planned, config) if req.recommend else None
    if args.json:
        print(json.dumps(_as_dict(plan, kv, comm, req, fc, ranking), indent=1))
    else:
        for part in (plan, kv and kv.describe(plan.mesh), comm and comm.describe(),
                     req.topology and req.topology.describe(), fc and fc.describe(),
                     ranking and forecast_request.describe_ranking(ranking, req)):
            if part:
                print(part)
    if req.plot is not None:
        _plot(args.path, req, plan, strategy, plan.mesh, fc, ranking)
    return 0


def _multislice(args, mesh):
    """The MultiSlice of --slices / --dcn-axes, checked against the mesh now (before a model is
    built), or None for one slice."""
    if args.slices == 1:
        return None
    slices = MultiSlice(args.slices, tuple(a.strip() for a in args.dcn_axes.split(",")))
    slices.split(mesh)          # a mesh the slices cannot divide: the error says how to fix it
    return slices


def _quantization(args):
    if args.bits is not None:
        return QuantizationConfig(n_bits=args.bits, block_size=args.block_size,
                                  symmetric=not args.asym)
    if args.block_size is not None or args.asym:
        raise ValueError("--block-size and --asym describe quantization: add --bits 8 or --bits 4")
    return None


def _attention(args):
    """--attention and --attention-layers: the kernel and its AttentionConfig, checked before a
    model is built."""
    if args.attention not in IMPLEMENTATIONS:
        raise ValueError(f"--attention {args.attention!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if args.attention_layers is None:
        return args.attention, None
    if args.attention == "eager":
        raise ValueError("--attention-layers chooses the layers that run --attention's kernel: "
                         "add --attention splash_attention or xla_flash_attention")
    try:
        layers = [int(i) for i in args.attention_layers.split(",")]
    except ValueError:
        raise ValueError(f"--attention-layers {args.attention_layers!r}: give layer indices "
                         "separated by commas, e.g. 0,1,2") from None
    return args.attention, AttentionConfig(layers=layers)


def _kv_cache(plan, args, req):
    """--batch with --max-len (and no --train): generation's static KV cache."""
    if req.training is not None or not (args.max_len is not None or
                                        (args.batch is not None and args.seq is None)):
        return None
    if args.batch is None or args.max_len is None:
        raise ValueError("--batch and --max-len go together: the KV cache of BATCH sequences "
                         "of MAX_LEN tokens")
    return plan.kv_cache(args.batch, args.max_len)


def _communication(plan, args):
    """--comm: a training step with --seq, else a decode step (the batch of --max-len)."""
    if not args.comm:
        if args.seq is not None and not args.train:
            raise ValueError("--seq is the training sequence length of --comm or --train: add "
                             "one of them")
        return None
    if args.batch is None or (args.seq is None and args.max_len is None):
        raise ValueError("--comm needs --batch B and --seq S (a training step) or --batch B and "
                         "--max-len L (a decode step)")

    if args.seq is not None:
        return communication(plan, batch=args.batch, seq=args.seq, train=True)
    return communication(plan, batch=args.batch, train=False)


def _as_dict(plan, kv, comm, req, fc, ranking) -> dict:
    d = plan.to_dict()
    if kv is not None:
        d["kv_cache"] = {**kv.__dict__, "bytes_per_device": kv.bytes_per_device(plan.mesh),
                         "total_bytes": kv.total_bytes}
    if comm is not None:
        d["communication"] = {k: dict(zip(("ops", "payload_bytes", "wire_bytes"), v))
                              for k, v in comm.totals().items()}
    if req.topology is not None:
        d["topology"] = req.topology.to_dict()
    if fc is not None:
        d["forecast"] = fc.to_dict()
    if ranking is not None:
        d["recommendation"] = [dict(strategy=s, mesh=dict(zip(("data", "fsdp", "model"),
                                    m.sizes)), bytes_per_device=t, fits=ok,
                                    wire_bytes_per_step=w) for ok, t, s, m, _, w in ranking]
    return d


def _plot(path, req, plan, strategy, mesh, fc, ranking) -> None:
    def label(s, m):
        return f"{s}\n{'x'.join(map(str, m.sizes))}"
    if ranking is not None:      # best first, as printed
        bars = [plot.bar(f"{i}. " + label(s, m), f, total)
                for i, (_, total, s, m, f, _) in enumerate(ranking, 1)]
    else:
        bars = [plot.bar(label(strategy, mesh), fc, plan.bytes_per_device())]
    what = {"train": "training step", "infer": "generation"}.get(fc.mode if fc else "", "weights")
    where = f"{req.topology.name} ({req.devices} chips)" if req.topology else \
        f"{req.devices} devices"
    fig = plot.render(bars, f"{path}: {what}, memory per device on {where}",
                      hbm_bytes=req.topology.hbm_bytes if req.topology else None,
                      capacity_bytes=fc.capacity if fc else None,
                      xlabel="strategy, mesh data x fsdp x model" + (
                          ", ranked as printed" if ranking is not None else ""))
    plot.save(fig, req.plot)
    print(f"autoxla: wrote the memory plot to {req.plot}", file=sys.stderr)
