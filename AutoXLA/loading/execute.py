"""The loading step executed: every tensor of a plan from the checkpoint into its sharded place on
the devices this host owns (``load``; a float weight the plan quantizes is quantized on the host as
it streams, by the C engine, and its quantized tensors sharded), or from a model already in memory
(``place``). What is filled from which checkpoint tensor (``loading_steps``, after
``checkpoint_sources`` checked that every one is there with its shape) is shared with the offline
quantizer (modeling/offline.py), which writes the same tensors to files instead of devices."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _native
from ..runtimes.xla import XlaRuntime
from ..planning.plan import Plan
from ..quantization.experts import quantize_experts
from ..quantization.linear import linear_rows, stored_tensors
from ..quantization.weights import quantize_tensor
from ..state import record_state, state_of
from . import checkpoint as ckpt
from . import streaming
from .converted import compose
from .host_quantize import host_quantized_shards, merged_stats

logger = logging.getLogger("AutoXLA")
XLA = XlaRuntime()
# Bytes sent to the devices before the loader waits for the copies (their host shards stay alive
# until the copy finishes).
_WAIT_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Step:
    """One planned tensor the loader fills, and from what."""

    tensor: Any        # its TensorPlan
    key: Any           # the checkpoint key, a Composite (loading/converted.py), or None: the
                       # model's own buffer (computed, or persistent and absent from the checkpoint)
    owner: nn.Module   # the module holding it, under ``leaf``
    leaf: str
    quantize: bool     # a float checkpoint weight the plan quantizes as it is read


def loading_steps(model: nn.Module, plan: Plan, checkpoint, state=None,
                  only: set | None = None) -> list[Step]:
    """What loading a checkpoint does, tensor by tensor in the plan's order, whatever the
    destination (this host's devices: ``load``; files: modeling/offline.py): every planned tensor
    but the tied ones (shared) and the quantized tensors made together with their weight.
    ``only``: the names to fill (the weights quantized into them are kept too)."""
    sources, quantize = checkpoint_sources(model, plan, checkpoint, state)
    steps = []
    for t in plan:
        if t.tied_to or t.derived_from in quantize:
            continue
        if only is not None and t.name not in only and t.name not in quantize:
            continue
        owner, leaf = owner_of(model, t.name)
        steps.append(Step(t, sources.get(t.name), owner, leaf, t.name in quantize))
    return steps


def quantize_weight(owner: nn.Module, w: torch.Tensor, label: str, importance=None,
                    stats: bool = True):
    """A float weight quantized by the C engine in its module's format: a QuantizedExperts'
    [E, ...] parameter (as the checkpoint stores it) expert by expert, a linear's (out, in)
    rows (``linear_rows``) whole."""
    if getattr(owner, "num_experts", None):
        return quantize_experts(w, owner, label)
    return quantize_tensor(w, owner.quant_format, label, importance=importance, stats=stats)


def read_whole(key, checkpoint, state=None) -> torch.Tensor:
    """The checkpoint tensor ``key`` whole, in its stored dtype: from pickle weights already in
    memory (``state``, handed over), from its file, or a Composite (experts stored one tensor per
    expert) assembled from its pieces."""
    if state is not None:
        return state.pop(key)
    if isinstance(key, str):
        return streaming.read_whole(checkpoint.records[key])
    return key.read_whole(checkpoint.records, checkpoint.records[key.pieces[0].key].dtype)


def load(model: nn.Module, plan: Plan, mesh, checkpoint: ckpt.Checkpoint,
         verbose: bool | None = False, smoothing=None, host=None, runtime=None) -> None:
    """Step 3: stream every tensor from the checkpoint into its sharded place on the devices.

    Each process builds the shards of the devices it addresses (``host``, default
    ``runtime.current_host()``) and reads only the bytes they hold (docs/multihost.md); one process
    on one host reads everything. ``smoothing`` (calibration's SmoothQuant factors) is applied on
    the host to the tensors it changes, which are read whole for that, before they are quantized
    or sharded. What was read is left on the model as ``autoxla_load`` (a LoadStats).
    ``runtime`` (runtimes/) builds the sharded tensors: the xla runtime by default; on the dtensor
    runtime each process is a host with one device and builds its DTensors' local pieces."""
    runtime = runtime or XLA
    host = host or runtime.current_host()
    state = (ckpt.load_pickle_state(checkpoint.pickle_files, checkpoint.pickle_map)
             if checkpoint.is_pickle else None)
    report = state_of(model).quantization
    progress = _progress(plan, verbose)
    smoothed = smoothing.tensor_names() if smoothing is not None else set()
    stats = LoadStats(host, checkpoint_bytes=sum(r.nbytes for r in checkpoint.records.values()))
    in_flight = 0
    for step in loading_steps(model, plan, checkpoint, state):
        t, key, owner, leaf = step.tensor, step.key, step.owner, step.leaf
        if step.quantize:
            in_flight += _load_quantized(owner, t, plan, mesh, key, state, checkpoint, report,
                                         smoothing if t.name in smoothed else None, host, stats,
                                         runtime)
        else:
            dtype = getattr(torch, t.dtype)
            if key is None:   # computed buffer (or a persistent one the checkpoint lacks)
                value = streaming.tensor_to_device(owner._buffers[leaf], t.spec, mesh, dtype, host,
                                                 runtime=runtime)
            elif t.name in smoothed:
                value = _read_host(key, state, checkpoint, stats)
                check_shape(t, tuple(value.shape), key)
                # In the load dtype, as calibration smoothed the float model on the devices.
                value = streaming.tensor_to_device(smoothing.transform(t.name, value.to(dtype)),
                                                   t.spec, mesh, dtype, host, runtime=runtime)
            elif not isinstance(key, str):       # experts stacked from one tensor per expert
                shards, read = key.host_shards(checkpoint.records, t.spec, mesh, host, dtype)
                stats.bytes_read += read
                value = streaming.to_device(shards, t.spec, mesh, t.shape, host, runtime)
                del shards
            elif state is not None:
                check_shape(t, tuple(state[key].shape), key)
                value = streaming.tensor_to_device(state.pop(key), t.spec, mesh, dtype, host,
                                                 runtime=runtime)
            else:
                record = checkpoint.records[key]
                check_shape(t, record.shape, key)
                shards, read = streaming.host_shards(record, t.spec, mesh, host, dtype)
                stats.bytes_read += read
                value = streaming.to_device(shards, t.spec, mesh, t.shape, host, runtime)
                del shards
            _assign(owner, leaf, value, t.is_buffer)
            in_flight += t.nbytes
        # Copies to the devices are asynchronous and keep their host shards (the tensor in its
        # load dtype) alive: wait once _WAIT_BYTES are in flight, whichever path made them.
        if in_flight >= _WAIT_BYTES:
            runtime.wait_for_transfers()
            # The host shards just freed stay in malloc's per-thread arenas otherwise, and the
            # process grows by a tensor's worth per layer (bench/moe_load.py: the peak fell from
            # model + 3.1 to model + 1.4 largest tensors with this)
            _native.release_freed_host_memory()
            in_flight = 0
        progress.update(1)
    progress.close()
    runtime.wait_for_transfers()
    _native.release_freed_host_memory()   # the host shards, freed but kept by malloc's arenas
    retie(model, plan)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
            if p.device.type == "meta"]
    if left:
        raise RuntimeError(f"internal error: {left[:5]} were planned but not loaded; please report")
    record_state(model, load=stats)
    if not host.is_everything:
        logger.info("%s", stats)


@dataclass
class LoadStats:
    """What one process read of the checkpoint while loading (docs/multihost.md)."""

    host: Any
    checkpoint_bytes: int
    bytes_read: int = 0

    def __str__(self) -> str:
        share = self.bytes_read / max(self.checkpoint_bytes, 1)
        return (f"host {self.host.index} of {self.host.count} ({len(self.host.devices)} devices) "
                f"read {self.bytes_read / 2**20:.1f} MiB of the checkpoint's "
                f"{self.checkpoint_bytes / 2**20:.1f} MiB ({share:.1%})")


def place(model: nn.Module, plan: Plan, mesh, runtime=None) -> None:
    """Step 3 for from_model: every tensor the model already holds, sent to its planned shards."""
    runtime = runtime or XLA
    in_flight, host = 0, runtime.current_host()
    for t in plan:
        if t.tied_to:
            continue
        owner, leaf = owner_of(model, t.name)
        current = owner._buffers[leaf] if t.is_buffer else owner._parameters[leaf]
        value = streaming.tensor_to_device(current.detach(), t.spec, mesh, getattr(torch, t.dtype),
                                           host, runtime=runtime)
        _assign(owner, leaf, value, t.is_buffer)
        in_flight += t.nbytes
        if in_flight >= _WAIT_BYTES:       # as in load(): bound the host copies in flight
            runtime.wait_for_transfers()
            in_flight = 0
    retie(model, plan)


def retie(model: nn.Module, plan: Plan) -> None:
    for target, source in plan_ties(plan).items():
        owner, leaf = owner_of(model, target)
        src_owner, src_leaf = owner_of(model, source)
        setattr(owner, leaf, getattr(src_owner, src_leaf))


def checkpoint_sources(model: nn.Module, plan: Plan, checkpoint, state) -> tuple[dict, set]:
    """(plan name -> checkpoint key or None, names of weights to quantize as they load), after
    checking that every weight the plan needs is in the checkpoint."""
    available = set(state) if state is not None else set(checkpoint.records)
    names, converted = ckpt.renamed_keys(model, available)
    composites = _composites(model, plan, checkpoint, converted, state)
    prefix, renamed = getattr(model, "base_model_prefix", "") + ".", set(names)

    def source(name: str):
        return composites.get(name) or names.get(_checkpoint_key(name, renamed, prefix))

    # A quantized expert projection is stored under its own name once saved quantized, and
    # made from its float parameter (``source_name``) otherwise.
    sources = {t.name: source(t.name) or (source(t.source_name) if t.source_name else None)
               for t in plan if not t.tied_to and t.persistent}
    # A quantized weight whose checkpoint tensor is float is quantized as it streams; its scale
    # and zero point come out of that call rather than from the checkpoint.
    quantize = {t.name for t in plan if t.backend and sources.get(t.name)
                and _source_dtype(sources[t.name], state, checkpoint).is_floating_point}
    missing = [t.name for t in plan
               if t.name in sources and sources[t.name] is None
               and (not t.is_buffer or t.backend or t.derived_from)   # weights, plain or quantized
               and t.derived_from not in quantize]
    if missing:
        raise ckpt.CheckpointError(
            f"{len(missing)} weight(s) of {plan.model_class} are not in {checkpoint.directory}: "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}. The checkpoint does not match its "
            "config (wrong model class, revision or subfolder?): re-save it with save_pretrained")
    used = {k for k in sources.values() if isinstance(k, str)}
    used.update(p.key for c in composites.values() for p in c.pieces)
    unexpected = available - used
    if unexpected:
        logger.warning("ignoring %d checkpoint tensor(s) the model does not have: %s",
                       len(unexpected), sorted(unexpected)[:5])
    return sources, quantize


def _composites(model: nn.Module, plan: Plan, checkpoint, converted: list[str], state) -> dict:
    """plan name -> Composite for the tensors transformers builds from several checkpoint
    tensors (loading/converted.py), or a CheckpointError naming what cannot be placed."""
    if not converted:
        return {}
    def refuse(what: str):
        raise ckpt.CheckpointError(
            f"{len(converted)} tensor(s) of {checkpoint.directory} need transformers' weight "
            f"conversion to load into {plan.model_class} ({what}); AutoXLA places stacked and "
            "concatenated experts, not other conversions: load the model with transformers and "
            "pass it to from_model, or re-save it in the current layout")

    if state is not None:
        refuse("from pickle weights; convert them to safetensors")
    renamings, converters = ckpt.weight_conversions(model)
    shapes = {t.name: tuple(t.shape) for t in plan}
    shapes.update({t.source_name: tuple(t.source_shape) for t in plan if t.source_name})
    composites, unsupported = compose(model, converted, converters, renamings, shapes)
    if unsupported:
        refuse(f"e.g. {unsupported[:3]}")
    for c in composites.values():
        problem = c.check(checkpoint.records)
        if problem:
            raise ckpt.CheckpointError(f"{checkpoint.directory}: {problem}; the checkpoint does "
                                       "not match its config: re-save it with save_pretrained")
    return composites


def _source_dtype(key, state, checkpoint) -> torch.dtype:
    if not isinstance(key, str):                  # a Composite: its pieces' dtype
        key = key.pieces[0].key
    return state[key].dtype if state is not None else checkpoint.records[key].dtype


def _read_host(key: str, state, checkpoint, stats: LoadStats) -> torch.Tensor:
    if state is None:
        stats.bytes_read += checkpoint.records[key].nbytes
    return read_whole(key, checkpoint, state)


def _load_quantized(owner: nn.Module, t, plan: Plan, mesh, key: str, state, checkpoint, report,
                    smoothing, host, stats: LoadStats, runtime) -> int:
    """Quantize one float checkpoint weight on the host (C engine), then shard its quantized
    tensors by their planned specs. Returns the bytes sent to the devices.

    One host quantizes the whole weight. One of several reads and quantizes only the pieces its
    devices' shards come from (loading/host_quantize.py), unless the weight is smoothed or comes
    from pickle weights, which are whole in memory anyway."""
    prefix = t.name.rpartition(".")[0]
    names = {leaf: f"{prefix}.{leaf}" if prefix else leaf
             for leaf in ("weight", "weight_scale", "weight_zero_point", "weight_offset")}
    leaves = {leaf: plan[name] for leaf, name in names.items() if name in plan}
    importance = report.importance(prefix) if report is not None else None   # calibration's
    label = f"{t.name} (checkpoint {f'tensor {key!r}' if isinstance(key, str) else key})"

    experts = getattr(owner, "num_experts", None)     # a QuantizedExperts' [E, ...] parameter

    def quantize(w, importance):
        return quantize_weight(owner, w, label, importance)

    if not isinstance(key, str):               # experts stacked from one tensor per expert
        shards, read, q = _quantized_pieces(key, owner, leaves, checkpoint, mesh, host, label)
        stats.bytes_read += read
    elif (host.is_everything or smoothing is not None or state is not None or experts
          or getattr(owner, "source_transposed", False)):
        # (Experts are read whole on each host too: few, and split by expert, not by rows; so
        # is a Conv1D's weight, whose rows are the checkpoint's columns.)
        w = _read_host(key, state, checkpoint, stats)
        check_shape(t, tuple(w.shape), key, expected=t.source_shape)
        w = linear_rows(owner, w)
        if smoothing is not None:  # in float32: quantize the product, not a bf16 rounding of it
            w = smoothing.transform(t.name, w.float())
        q = quantize(w, importance)
        del w
        shards = {leaf: streaming.split_for_host(value, leaves[leaf].spec, mesh, host)
                  for leaf, value in stored_tensors(q).items()}
    else:
        record = checkpoint.records[key]
        check_shape(t, record.shape, key, expected=t.source_shape)
        shards, read, q = host_quantized_shards(record, leaves, owner.quant_format, mesh, host,
                                                quantize, importance)
        stats.bytes_read += read
    if report is not None:     # on several hosts: the statistics of this host's pieces
        report.record_stats(prefix, q)
    sent = 0
    for leaf, by_device in shards.items():
        entry = leaves[leaf]
        owner._buffers[leaf] = streaming.to_device(by_device, entry.spec, mesh, entry.shape, host,
                                                   runtime)
        sent += entry.nbytes
    return sent


def _quantized_pieces(composite, owner: nn.Module, leaves: dict, checkpoint, mesh, host,
                      label: str):
    """``_load_quantized`` of a quantized expert projection whose checkpoint holds one tensor per
    expert (loading/converted.py): each piece is read and quantized alone by the C engine (its
    rows are whole rows of the projection, so this is the whole projection's result piece by
    piece) and lands in the quantized tensors' shards. Returns (shards, bytes read, stats)."""
    if owner.source_transposed:
        raise ckpt.CheckpointError(
            f"{label}: one tensor per expert in the transposed layout [experts, in, out] cannot be "
            "quantized as it streams; re-save the checkpoint with save_pretrained (fused experts)")
    results = []

    def read(record, wanted):
        # whole pieces: the statistics are the whole projection's, and a quantized row is whole
        q = quantize_tensor(streaming.read_whole(record), owner.quant_format, label)
        results.append(q)
        box = [(0, 1)] * (len(wanted) - len(record.shape)) + [(0, n) for n in record.shape]
        return stored_tensors(q), box, record.nbytes

    targets = {leaf: (e.spec, e.shape, getattr(torch, e.dtype)) for leaf, e in leaves.items()}
    shards, read_bytes = composite.assemble(checkpoint.records, targets, mesh, host, read)
    return shards, read_bytes, merged_stats(results)


def plan_ties(plan: Plan) -> dict[str, str]:
    return {t.name: t.tied_to for t in plan if t.tied_to}


def _checkpoint_key(name: str, available: set[str], prefix: str) -> str | None:
    if name in available:
        return name
    # A base-model checkpoint ("layers.0...") loaded into a model with a head ("model.layers.0...").
    if prefix != "." and name.startswith(prefix) and name[len(prefix):] in available:
        return name[len(prefix):]
    return None


def check_shape(t, shape, key, expected=None) -> None:
    expected = tuple(expected or t.shape)
    if tuple(shape) != expected:
        raise ckpt.CheckpointError(
            f"checkpoint tensor {key!r} has shape {tuple(shape)} but the model's {t.name!r} needs "
            f"{expected}: the checkpoint and its config.json disagree; re-save the checkpoint "
            "or fix the config")


def owner_of(model: nn.Module, name: str):
    if "." not in name:
        return model, name
    path, leaf = name.rsplit(".", 1)
    return model.get_submodule(path), leaf


def _assign(owner: nn.Module, leaf: str, value: torch.Tensor, is_buffer: bool) -> None:
    if is_buffer:
        owner._buffers[leaf] = value
    else:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)


def _progress(plan: Plan, verbose: bool | None):
    """A bar as transformers shows while loading: by default only on a terminal (tqdm's
    disable=None), always with verbose=True, never with verbose=False."""
    from tqdm.auto import tqdm

    return tqdm(total=sum(1 for t in plan if not t.tied_to), desc="AutoXLA: loading",
                unit="tensor", disable=None if verbose is None else not verbose)
