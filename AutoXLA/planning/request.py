"""What `autoxla plan`'s forecast flags ask for (--train / --infer, --topology, --recommend,
--plot), and the forecasts and ranking they produce.

The flags are checked together once (``Request``), before any model is built, so a bad
combination is one clear error.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..sharding.mesh import MeshShape, mesh_shape_for
from .communication import communication
from .memory import OPTIMIZERS, InferenceSetup, TrainingSetup, inference_forecast, training_forecast
from .plot import check_path
from .topology import PRESETS, Topology, topology

# Headroom kept free for what the forecast does not count (XLA temporaries, fragmentation).
DEFAULT_HEADROOM = 0.10
RECOMMEND_STRATEGIES = ("fsdp", "2d", "3d", "mp", "dp")


@contextlib.contextmanager
def one_thread():
    """Planning computes only small buffers (Swin's relative position tables, rotary tables):
    torch's intra-op threads cost more than they save, 3x on a loaded 2-core host (Mask2Former
    Swin-L: 3.1 s -> 1.1 s, measured). Restored after, for a caller in the same process."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class Request:
    devices: int
    topology: Topology | None
    training: TrainingSetup | None
    inference: InferenceSetup | None
    headroom: float
    recommend: bool
    plot: str | None = None      # the picture's file (planning/plot.py), checked writable
    lora_rank: int | None = None  # LoRA adapters planned on the decoder layers (adapters.py)
    # The decoder stack planned scanned (adapters then stacked with their layers), unless
    # --no-scan.
    scan: bool = True


def request(args) -> Request:
    """The forecast the flags ask for, or a ValueError naming the bad combination and the fix."""
    if args.train and args.infer:
        raise ValueError("--train and --infer forecast different programs: pass one of them")
    if args.scan and args.no_scan:
        raise ValueError("--scan and --no-scan contradict each other: pass one of them")
    if not args.train:
        for flag, value in (("--optimizer", args.optimizer),
                            ("--grad-ckpt", args.grad_ckpt or None)):
            if value is not None:
                raise ValueError(f"{flag} describes a training step: add --train")
    topo = topology(args.topology) if args.topology is not None else None
    devices = args.devices
    if topo is not None:
        if devices is not None and devices != topo.chips:
            raise ValueError(f"--devices {devices} contradicts --topology {topo.name} "
                             f"({topo.chips} chips): drop --devices")
        devices = topo.chips
    if args.recommend and topo is None:
        raise ValueError(f"--recommend ranks strategies for a slice: add --topology (one of "
                         f"{', '.join(PRESETS)})")
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom {args.headroom} is not a fraction of HBM in [0, 1)")
    training = inference = None
    if args.train:
        if args.batch is None or args.seq is None:
            raise ValueError("--train needs --batch B and --seq S: the step's sequences and "
                             "their length")
        if args.max_len is not None:
            raise ValueError("--max-len sizes generation's KV cache: use --seq with --train")
        training = TrainingSetup(args.batch, args.seq, args.optimizer or "adamw", args.grad_ckpt)
    if args.infer:
        if args.batch is None or args.max_len is None:
            raise ValueError("--infer needs --batch B and --max-len L: the sequences generated "
                             "at once and the KV cache's length")
        inference = InferenceSetup(args.batch, args.max_len)
    if args.plot is not None:
        check_path(args.plot)
    lora = getattr(args, "lora_rank", None)
    if lora is not None:
        if isinstance(lora, bool) or not isinstance(lora, int) or lora < 1:
            raise ValueError(f"--lora-rank {lora!r}: give a rank >= 1")
        if args.infer:
            raise ValueError("--lora-rank with --infer: generation with adapters is planned as "
                             "training is not; merge the adapter (merge_and_save) and forecast "
                             "the merged checkpoint")
    return Request(devices if devices is not None else 8, topo, training, inference,
                   args.headroom, args.recommend, args.plot, lora,
                   scan=not args.no_scan)


def forecast(req: Request, plan, config):
    """The Forecast for ``plan``, against the topology's HBM minus the headroom; None if neither
    --train nor --infer was asked."""
    if req.training is not None:
        f = training_forecast(plan, config, req.training)
    elif req.inference is not None:
        f = inference_forecast(plan, config, req.inference)
    else:
        return None
    if req.topology is not None:
        f.capacity = int(req.topology.hbm_bytes * (1 - req.headroom))
        f.notes.append(f"capacity: {req.topology.hbm_bytes / 2**30:.0f} GiB HBM per chip less "
                       f"{req.headroom:.0%} headroom for XLA temporaries and fragmentation")
    return f


def mesh_candidates(devices: int):
    """(strategy, MeshShape) to try on ``devices``: each strategy's own mesh, and for 2d and 3d
    every model-axis size that is a power of two up to 16 (Megatron's all-reduces want the model
    axis small and inside a host)."""
    seen, out = set(), []
    for s in RECOMMEND_STRATEGIES:
        shapes = [mesh_shape_for(s, devices)]
        if s in ("2d", "3d"):
            for m in (2, 4, 8, 16):
                rest = devices // m
                if devices % m or rest < 2:
                    continue
                if s == "2d":
                    shapes.append(MeshShape(1, rest, m))
                else:
                    for d in (2, 4, 8):
                        if rest % d == 0 and rest // d >= 2:
                            shapes.append(MeshShape(d, rest // d, m))
        for shape in shapes:
            if shape.sizes not in seen:
                seen.add(shape.sizes)
                out.append((s, shape))
    return out


def recommend(req: Request, build, config) -> list[tuple]:
    """Every candidate mesh as (fits, bytes per device, strategy, mesh, forecast or None, wire
    bytes per step or None), best first: fitting ones before the others; among those that fit,
    the one that communicates least per step (planning/communication.py, for a decoder LM with
    --train or --infer), then fewer bytes per device. ``build(strategy, mesh)`` makes the plan."""
    rows = []
    cap = int(req.topology.hbm_bytes * (1 - req.headroom))
    for strategy, mesh in mesh_candidates(req.devices):
        plan = build(strategy, mesh)
        f = forecast(req, plan, config)
        total = f.total if f is not None else plan.bytes_per_device()
        rows.append((total <= cap, total, strategy, mesh, f, _wire_bytes(req, plan)))
    rows.sort(key=lambda r: (not r[0], (r[5] or 0) if r[0] else 0, r[1]))
    return rows


def _wire_bytes(req: Request, plan) -> float | None:
    """Bytes each device sends per step over all collectives (ring estimate), or None."""
    if plan.attention is None:
        return None
    if req.training is not None:
        report = communication(plan, batch=req.training.batch, seq=req.training.seq, train=True)
    elif req.inference is not None:
        report = communication(plan, batch=req.inference.batch, train=False)
    else:
        return None
    return sum(wire for _, _, wire in report.totals().values())


def describe_ranking(rows, req: Request) -> str:
    cap = req.topology.hbm_bytes * (1 - req.headroom)
    by_comm = any(r[5] is not None for r in rows)
    lines = [f"recommendation for {req.topology.name} ({req.devices} chips): fitting meshes first"
             + (", by communication per step (wire bytes per device, planning/communication.py),"
                if by_comm else " (communication is ranked with --train or --infer)")
             + " then by bytes per device:"]
    for i, (fits, total, strategy, mesh, _, wire) in enumerate(rows, 1):
        comm = f"  comm {wire / 2**30:8.3f} GiB/step" if wire is not None else ""
        lines.append(f"  {i:2d}. {strategy:4s} {str(mesh):28s} {total / 2**30:9.3f} GiB/device "
                     f"{'fits' if fits else 'does not fit'} ({(cap - total) / 2**30:+.3f} GiB)"
                     f"{comm}")
    return "\n".join(lines)
