"""The five steps every entry point runs: resolve, plan, load, patch, wrap (DESIGN.md section 1)."""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _native, backend, generation
from ..attention import patch_attention
from ..attention.config import TRANSFORMERS_NAMES
from ..attention.hf import register as register_attention
from ..attention.patch import set_decoder_attention
from ..generation import compile_cache
from ..loading import checkpoint as ckpt
from ..loading import streaming
from ..sharding.mesh import mesh_shape_for
from ..sharding.plan import Plan, build_plan
from . import dynamic_cache, experts
from . import wrap as wrapping
from .empty import check_sizes, load_config, parameters_on_meta
from .options import LoadOptions

logger = logging.getLogger("AutoXLA")
_WAIT_BYTES = 32 * 2**20


@dataclass
class Resolved:
    config: Any
    model: nn.Module            # parameters on meta, buffers on the CPU
    dtype: torch.dtype
    tied: dict[str, str]        # target name -> source name


def resolve(path, auto_class, opts: LoadOptions) -> Resolved:
    """Step 1: config and an empty model of the right class (no weights read).

    ``auto_class`` is a transformers auto class, a sequence of them tried in order (the first
    whose mapping knows the config's type is used), or a function of the config that returns one.
    """
    config, unused = load_config(
        path, trust_remote_code=opts.trust_remote_code, return_unused_kwargs=True,
        **opts.hub_kwargs, **opts.config_kwargs)
    if unused:
        raise TypeError(
            f"from_pretrained() got unexpected keyword argument(s) {sorted(unused)}: they are "
            "neither AutoXLA options (sharding_strategy, mesh, auto_shard, use_fsdp_wrap, "
            "auto_wrap_policy, shard_output_callable, gradient_checkpointing, verbose, dtype, "
            "attn_implementation, attention_config, do_quant, quantization_config, calibration, "
            "xla_patch_linear, generation_options, compile_cache, scan_layers, multislice) nor "
            "fields of the model's config; check the spelling")
    config._attn_implementation = opts.attn_implementation
    experts.use_for(config)     # static-shape mixture-of-experts layers (modeling/experts.py)
    if opts.attn_implementation != "eager":
        register_attention()   # transformers must know the name before the model is built
        set_decoder_attention(config, TRANSFORMERS_NAMES[opts.attn_implementation])
    if isinstance(auto_class, (tuple, list)):
        auto_class = pick_auto_class(auto_class, config)
    elif not hasattr(auto_class, "from_config"):     # a chooser: config -> auto class
        auto_class = auto_class(config)
    return empty_model(config, auto_class, opts.dtype, opts.trust_remote_code)


def pick_auto_class(candidates, config):
    """The first auto class whose mapping holds ``config``'s type, or an error naming them all."""
    for auto_class in candidates:
        if type(config) in getattr(auto_class, "_model_mapping", {}):
            return auto_class
    tried = ", ".join(c.__name__ for c in candidates)
    raise ValueError(f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')!r}) "
                     f"is not a model any of {tried} can build; this loader takes segmentation "
                     "checkpoints (SAM, SAM2, SAM3, Mask2Former, OneFormer, SegFormer, UperNet, "
                     "...), not text models (AutoXLAModelForCausalLM loads those). For a model "
                     "built some other way, use from_model(model)")


def empty_model(config, auto_class, dtype="auto", trust_remote_code: bool = False) -> Resolved:
    """The model of ``config`` with parameters on meta and buffers on the CPU, and its ties.

    Shared by from_pretrained and ``autoxla plan``, so the plan a user previews is the plan the
    loader executes.
    """
    check_sizes(config)
    dtype = resolve_dtype(dtype, config)
    with parameters_on_meta():
        model = auto_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.eval()
    experts.check_supported(model)
    tied = {}
    if hasattr(model, "get_expanded_tied_weights_keys"):
        tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    return Resolved(config, model, dtype, tied)


def resolve_dtype(dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if isinstance(saved, torch.dtype) else torch.float32


def adopt(model: nn.Module, opts: LoadOptions) -> Resolved:
    """Step 1 for from_model: a model that is already built, with its weights (on the CPU)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_model needs a torch.nn.Module, got {type(model).__name__}")
    on = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    if on - {"cpu"}:
        raise ValueError(f"from_model needs the model's weights on the CPU, found them on "
                         f"{sorted(on - {'cpu'})}: build it on the CPU (or call model.cpu()) and "
                         "AutoXLA shards it onto the XLA devices")
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = opts.dtype if isinstance(opts.dtype, torch.dtype) else (
        floating[0] if floating else torch.float32)
    if hasattr(model, "get_expanded_tied_weights_keys"):
        tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    else:   # a plain nn.Module: parameters registered under two names share one tensor
        first, tied = {}, {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[name] = first[id(p)]
            else:
                first[id(p)] = name
    model.eval()
    return Resolved(getattr(model, "config", None), model, dtype, tied)


def patch_linears(model: nn.Module, opts: LoadOptions) -> None:
    """Step 2b: torch_xla's einsum nn.Linear (sharding propagates through it), before the plan.
    Quantized linears are not nn.Linear and keep their own forward."""
    if opts.xla_patch_linear:
        backend.patch_linear_for_spmd(model)


def make_plan(resolved: Resolved, opts: LoadOptions):
    """Step 2: the mesh and the plan of every tensor on it."""
    if opts.mesh is not None:
        (shape, mesh), strategy = backend.adopt_user_mesh(opts.mesh), "custom mesh"
    else:
        shape = mesh_shape_for(opts.sharding_strategy, backend.device_count())
        mesh, strategy = backend.make_mesh(shape, opts.multislice), opts.sharding_strategy
    plan = build_plan(resolved.model, resolved.config, shape, strategy, resolved.dtype, resolved.tied,
                      scan_layers=opts.scan_layers)
    if opts.multislice is not None:
        plan.notes.append("links: " + opts.multislice.links(shape))
    host = backend.current_host()
    if host.simulated:
        plan.simulated_host = f"{host.index}/{host.count}"
        warnings.warn(f"AUTOXLA_SIMULATE_HOST={plan.simulated_host}: this process loads the shards "
                      f"of simulated host {host.index} of {host.count} only; the other devices hold "
                      "NaN, so outputs are not meaningful (a multi-host test setting; unset it to "
                      "run the model)", RuntimeWarning, stacklevel=3)
    return plan, mesh


def load(model: nn.Module, plan: Plan, mesh, checkpoint: ckpt.Checkpoint,
         verbose: bool | None = False, smoothing=None, host=None) -> None:
    """Step 3: stream every tensor from the checkpoint into its sharded place on the devices.

    Each process builds the shards of the devices it addresses (``host``, default
    ``backend.current_host()``) and reads only the bytes they hold (docs/multihost.md); one process
    on one host reads everything. ``smoothing`` (calibration's SmoothQuant factors) is applied on
    the host to the tensors it changes, which are read whole for that, before they are quantized
    or sharded. What was read is left on the model as ``autoxla_load`` (a LoadStats)."""
    host = host or backend.current_host()
    state = (ckpt.load_pickle_state(checkpoint.pickle_files, checkpoint.pickle_map)
             if checkpoint.is_pickle else None)
    sources, quantize = _sources(model, plan, checkpoint, state)
    report = getattr(model, "autoxla_quantization", None)
    progress = _progress(plan, verbose)
    smoothed = smoothing.tensor_names() if smoothing is not None else set()
    stats = LoadStats(host, checkpoint_bytes=sum(r.nbytes for r in checkpoint.records.values()))
    in_flight = 0
    for t in plan:
        if t.tied_to or t.derived_from in quantize:   # shared, or made with its weight below
            continue
        key = sources.get(t.name)
        owner, leaf = _owner(model, t.name)
        if t.name in quantize:
            in_flight += _load_quantized(owner, t, plan, mesh, key, state, checkpoint, report,
                                         smoothing if t.name in smoothed else None, host, stats)
        else:
            dtype = getattr(torch, t.dtype)
            if key is None:   # computed buffer (or a persistent one the checkpoint lacks)
                value = streaming.tensor_to_device(owner._buffers[leaf], t.spec, mesh, dtype, host)
            elif t.name in smoothed:
                value = _read_host(key, state, checkpoint, stats)
                _check_shape(t, tuple(value.shape), key)
                # In the load dtype, as calibration smoothed the float model on the devices.
                value = streaming.tensor_to_device(smoothing.transform(t.name, value.to(dtype)),
                                                   t.spec, mesh, dtype, host)
            elif not isinstance(key, str):       # experts stacked from one tensor per expert
                shards, read = key.host_shards(checkpoint.records, t.spec, mesh, host, dtype)
                stats.bytes_read += read
                value = streaming.to_device(shards, t.spec, mesh, t.shape, host)
                del shards
            elif state is not None:
                _check_shape(t, tuple(state[key].shape), key)
                value = streaming.tensor_to_device(state.pop(key), t.spec, mesh, dtype, host)
            else:
                record = checkpoint.records[key]
                _check_shape(t, record.shape, key)
                shards, read = streaming.host_shards(record, t.spec, mesh, host, dtype)
                stats.bytes_read += read
                value = streaming.to_device(shards, t.spec, mesh, t.shape, host)
                del shards
            _assign(owner, leaf, value, t.is_buffer)
            in_flight += t.nbytes
        # Copies to the devices are asynchronous and keep their host shards (the tensor in its
        # load dtype) alive: wait once _WAIT_BYTES are in flight, whichever path made them.
        if in_flight >= _WAIT_BYTES:
            backend.wait_for_transfers()
            # The host shards just freed stay in malloc's per-thread arenas otherwise, and the
            # process grows by a tensor's worth per layer (bench/moe_load.py: the peak fell from
            # model + 3.1 to model + 1.4 largest tensors with this)
            _native.release_freed_host_memory()
            in_flight = 0
        progress.update(1)
    progress.close()
    backend.wait_for_transfers()
    _native.release_freed_host_memory()   # the host shards, freed but kept by malloc's arenas
    _retie(model, plan)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
            if p.device.type == "meta"]
    if left:
        raise RuntimeError(f"internal error: {left[:5]} were planned but not loaded; please report")
    model.autoxla_load = stats
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


def place(model: nn.Module, plan: Plan, mesh) -> None:
    """Step 3 for from_model: every tensor the model already holds, sent to its planned shards."""
    in_flight, host = 0, backend.current_host()
    for t in plan:
        if t.tied_to:
            continue
        owner, leaf = _owner(model, t.name)
        current = owner._buffers[leaf] if t.is_buffer else owner._parameters[leaf]
        value = streaming.tensor_to_device(current.detach(), t.spec, mesh, getattr(torch, t.dtype),
                                           host)
        _assign(owner, leaf, value, t.is_buffer)
        in_flight += t.nbytes
        if in_flight >= _WAIT_BYTES:       # as in load(): bound the host copies in flight
            backend.wait_for_transfers()
            in_flight = 0
    _retie(model, plan)


def _retie(model: nn.Module, plan: Plan) -> None:
    for target, source in plan_ties(plan).items():
        owner, leaf = _owner(model, target)
        src_owner, src_leaf = _owner(model, source)
        setattr(owner, leaf, getattr(src_owner, src_leaf))


def _sources(model: nn.Module, plan: Plan, checkpoint, state) -> tuple[dict, set]:
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
    from ..loading.converted import compose

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
    if state is not None:
        return state.pop(key)
    stats.bytes_read += checkpoint.records[key].nbytes
    return streaming.read_whole(checkpoint.records[key])


def _load_quantized(owner: nn.Module, t, plan: Plan, mesh, key: str, state, checkpoint, report,
                    smoothing, host, stats: LoadStats) -> int:
    """Quantize one float checkpoint weight on the host (C engine), then shard its quantized
    tensors by their planned specs. Returns the bytes sent to the devices.

    One host quantizes the whole weight. One of several reads and quantizes only the pieces its
    devices' shards come from (loading/host_quantize.py), unless the weight is smoothed or comes
    from pickle weights, which are whole in memory anyway."""
    from ..loading.host_quantize import host_quantized_shards
    from ..quantization.experts import quantize_experts
    from ..quantization.linear import stored_tensors
    from ..quantization.weights import quantize_tensor

    prefix = t.name.rpartition(".")[0]
    names = {leaf: f"{prefix}.{leaf}" if prefix else leaf
             for leaf in ("weight", "weight_scale", "weight_zero_point", "weight_offset")}
    leaves = {leaf: plan[name] for leaf, name in names.items() if name in plan}
    importance = report.importance(prefix) if report is not None else None   # calibration's
    label = f"{t.name} (checkpoint {f'tensor {key!r}' if isinstance(key, str) else key})"

    experts = getattr(owner, "num_experts", None)     # a QuantizedExperts' [E, ...] parameter

    def quantize(w, importance):
        if experts:
            return quantize_experts(w, owner, label)
        return quantize_tensor(w, owner.quant_format, label, importance=importance)

    if not isinstance(key, str):               # experts stacked from one tensor per expert
        shards, read, q = _quantized_pieces(key, owner, leaves, checkpoint, mesh, host, label)
        stats.bytes_read += read
    elif host.is_everything or smoothing is not None or state is not None or experts:
        # (Experts are read whole on each host too: few, and split by expert, not by rows.)
        w = _read_host(key, state, checkpoint, stats)
        _check_shape(t, tuple(w.shape), key, expected=t.source_shape)
        if smoothing is not None:  # in float32: quantize the product, not a bf16 rounding of it
            w = smoothing.transform(t.name, w.float())
        q = quantize(w, importance)
        del w
        shards = {leaf: streaming.split_for_host(value, leaves[leaf].spec, mesh, host)
                  for leaf, value in stored_tensors(q).items()}
    else:
        record = checkpoint.records[key]
        _check_shape(t, record.shape, key, expected=t.source_shape)
        shards, read, q = host_quantized_shards(record, leaves, owner.quant_format, mesh, host,
                                                quantize, importance)
        stats.bytes_read += read
    if report is not None:     # on several hosts: the statistics of this host's pieces
        report.record_stats(prefix, q)
    sent = 0
    for leaf, by_device in shards.items():
        entry = leaves[leaf]
        owner._buffers[leaf] = streaming.to_device(by_device, entry.spec, mesh, entry.shape, host)
        sent += entry.nbytes
    return sent


def _quantized_pieces(composite, owner: nn.Module, leaves: dict, checkpoint, mesh, host,
                      label: str):
    """``_load_quantized`` of a quantized expert projection whose checkpoint holds one tensor per
    expert (loading/converted.py): each piece is read and quantized alone by the C engine (its
    rows are whole rows of the projection, so this is the whole projection's result piece by
    piece) and lands in the quantized tensors' shards. Returns (shards, bytes read, stats)."""
    from ..loading.host_quantize import merged_stats
    from ..quantization.linear import stored_tensors
    from ..quantization.weights import quantize_tensor

    if owner.source_transposed:
        raise ckpt.CheckpointError(
            f"{label}: one tensor per expert in the transposed layout [experts, in, out] cannot be "
            "quantized as it streams; re-save the checkpoint with save_pretrained (fused experts)")
    results = []

    def read(record):
        q = quantize_tensor(streaming.read_whole(record), owner.quant_format, label)
        results.append(q)
        return stored_tensors(q)

    targets = {leaf: (e.spec, e.shape, getattr(torch, e.dtype)) for leaf, e in leaves.items()}
    shards, read_bytes = composite.assemble(checkpoint.records, targets, mesh, host, read)
    return shards, read_bytes, merged_stats(results)


def stack_layers(model: nn.Module, plan: Plan, mesh) -> None:
    """Step 4b: a decoder stack the plan scans gets its layers' tensors stacked (modeling/scan.py).
    The plan decided from the empty model; the attention patch may since have made some layers
    differ (attention_config's layers), which the plan then records as the reason."""
    if plan.stack is None or not plan.stack.scanned:
        return
    from ..sharding.decoder_stack import find_stack
    from .scan import stack_decoder

    plan.stack = plan.stack.rechecked(find_stack(model)[1])
    if plan.stack.scanned:
        stack_decoder(model, plan.stack, plan, mesh)


def plan_ties(plan: Plan) -> dict[str, str]:
    return {t.name: t.tied_to for t in plan if t.tied_to}


def _checkpoint_key(name: str, available: set[str], prefix: str) -> str | None:
    if name in available:
        return name
    # A base-model checkpoint ("layers.0...") loaded into a model with a head ("model.layers.0...").
    if prefix != "." and name.startswith(prefix) and name[len(prefix):] in available:
        return name[len(prefix):]
    return None


def _check_shape(t, shape, key, expected=None) -> None:
    expected = tuple(expected or t.shape)
    if tuple(shape) != expected:
        raise ckpt.CheckpointError(
            f"checkpoint tensor {key!r} has shape {tuple(shape)} but the model's {t.name!r} needs "
            f"{expected}: the checkpoint and its config.json disagree; re-save the checkpoint "
            "or fix the config")


def _owner(model: nn.Module, name: str):
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


def quantize_on_meta(resolved: Resolved, requested, on_tpu: bool):
    """Step 2a: swap in QuantizedLinear layers while the model is still empty, so the plan shows
    the quantized tensors and the loader fills them (quantizing float weights as they stream).

    ``requested`` is the user's QuantizationConfig or None. A checkpoint AutoXLA saved quantized
    is loaded as such: its config.json holds the format. Returns the config used, or None.
    """
    from ..quantization import ModelQuantizer, QuantizationConfig

    saved = getattr(resolved.config, "quantization_config", None)
    cfg = requested
    if saved is not None:
        saved = saved if isinstance(saved, dict) else saved.to_dict()
        method = saved.get("quant_method")
        if method != "autoxla":
            raise ValueError(f"the checkpoint is quantized with {method!r}, which AutoXLA cannot "
                             "load; use its float checkpoint with do_quant=True instead")
        saved = QuantizationConfig.from_dict(saved)
        if cfg is not None and not cfg.same_weights_as(saved):
            raise ValueError(
                f"the checkpoint is already quantized (n_bits={saved.n_bits}, block_size="
                f"{saved.block_size}, symmetric={saved.symmetric}) and cannot be quantized again "
                "with a different format; load it without quantization_config, or quantize its "
                "float checkpoint")
        cfg = cfg or saved
    if cfg is not None:
        ModelQuantizer(cfg).quantize_model(resolved.model, tied=resolved.tied, on_tpu=on_tpu)
    return cfg


def build(path, auto_class, opts: LoadOptions) -> nn.Module:
    """from_pretrained, top to bottom."""
    compile_cache.enable(opts.compile_cache)           # 0. before anything compiles (or $ENV)
    resolved = resolve(path, auto_class, opts)                                       # 1. resolve
    checkpoint = ckpt.locate(path, use_safetensors=opts.use_safetensors, **opts.hub_kwargs)
    qconfig, smoothing, calibration = opts.quantization_config, None, None
    if opts.calibration is not None:                       # 1b. float model, calibrated, dropped
        qconfig, smoothing, calibration = calibrate_float(path, auto_class, opts, resolved, checkpoint)
    quantize_on_meta(resolved, qconfig, backend.pallas_target())                 # 2a. quantized linears
    if calibration is not None:
        resolved.model.autoxla_quantization.attach_calibration(calibration)
    patch_linears(resolved.model, opts)                                     # 2b. einsum linears
    plan, mesh = make_plan(resolved, opts)                                           # 2. plan
    if opts.verbose:
        print(plan)
    load(resolved.model, plan, mesh, checkpoint, opts.verbose, smoothing)  # 3. load (+ quantize)
    return _finish(resolved.model, plan, mesh, opts)                        # 4. patch, 5. wrap


def calibrate_float(path, auto_class, opts: LoadOptions, resolved: Resolved, checkpoint):
    """Step 1b (calibration=...): load the float model sharded (eager attention, no scan, no
    quantization), calibrate it, smooth it and measure each layer (quantization/sensitivity.py),
    then free it. Returns (the QuantizationConfig to quantize with, the smoothing the loader
    applies to the checkpoint's tensors, the CalibrationReport). Costs a second read of the
    checkpoint instead of a second copy of the model on the devices."""
    import dataclasses
    import gc

    from ..quantization import sensitivity

    if getattr(resolved.config, "quantization_config", None) is not None:
        raise ValueError(f"calibration=... needs a float checkpoint, but {path} is already "
                         "quantized (its config.json has quantization_config): calibrate when "
                         "quantizing its float checkpoint, or load this one without calibration")
    if not (hasattr(resolved.model, "can_generate") and resolved.model.can_generate()):
        raise ValueError(f"calibration=... scores next tokens, but {type(resolved.model).__name__} "
                         "is not a language model; quantize it without calibration")
    tokenizer = _tokenizer(path, opts) if opts.calibration.needs_tokenizer else None
    float_opts = dataclasses.replace(opts, quantization_config=None, do_quant=False,
                                     calibration=None, attn_implementation="eager",
                                     attention_config=None, xla_patch_linear=False)
    floating = resolve(path, auto_class, float_opts)
    plan, mesh = make_plan(floating, float_opts)
    load(floating.model, plan, mesh, checkpoint, False)
    backend.set_global_mesh(mesh)     # results read back are replicated over it
    try:
        return sensitivity.run(floating.model, opts.calibration, opts.quantization_config,
                               tokenizer, floating.tied, backend.pallas_target())
    finally:
        del floating
        gc.collect()


def _tokenizer(path, opts: LoadOptions):
    """The checkpoint's tokenizer, for calibration text."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=opts.trust_remote_code,
                                             **opts.hub_kwargs)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"calibration text needs the checkpoint's tokenizer, but none loads from "
                         f"{path} ({type(e).__name__}: {e}). Save the tokenizer with the "
                         "checkpoint, or calibrate on token ids: calibration=torch.tensor([...])"
                         ) from e


def build_from_model(model: nn.Module, opts: LoadOptions) -> nn.Module:
    """from_model, top to bottom: the same steps on a model that already holds its weights."""
    compile_cache.enable(opts.compile_cache)           # 0. before anything compiles (or $ENV)
    resolved = adopt(model, opts)                                                    # 1. adopt
    if opts.calibration is not None:
        raise ValueError("from_model does not calibrate: quantize the model first with "
                         "ModelQuantizer(config).quantize_model(model, calibration=...), or use "
                         "from_pretrained(..., calibration=...)")
    if opts.quantization_config is not None:                                # 2a. quantize in C
        from ..quantization import ModelQuantizer

        ModelQuantizer(opts.quantization_config).quantize_model(
            resolved.model, tied=resolved.tied, on_tpu=backend.pallas_target())
    patch_linears(resolved.model, opts)                                     # 2b. einsum linears
    plan, mesh = make_plan(resolved, opts)                                           # 2. plan
    if opts.verbose:
        print(plan)
    place(resolved.model, plan, mesh)                                                # 3. place
    return _finish(resolved.model, plan, mesh, opts)                        # 4. patch, 5. wrap


def _finish(model: nn.Module, plan: Plan, mesh, opts: LoadOptions) -> nn.Module:
    if opts.attn_implementation != "eager":                                         # 4. patch
        patch_attention(model, opts.attn_implementation, opts.attention_config, mesh)
    experts.place(model, plan)             # 4. mixture-of-experts layers: the plan's split
    stack_layers(model, plan, mesh)                                           # 4b. scan
    if plan.attention is not None:           # 4c. plain forwards: XLA-safe sliding cache layers
        dynamic_cache.install(model)
    model = wrapping.wrap(model, plan, mesh, opts)                                   # 5. wrap
    if plan.attention is not None:                              # 6. fixed-shape generation
        generation.attach(model, opts.generation_options)
    backend.set_global_mesh(mesh)
    return model
