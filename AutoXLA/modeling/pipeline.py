"""The five steps every entry point runs: resolve, plan, load, patch, wrap (DESIGN.md section 1)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import backend
from ..loading import checkpoint as ckpt
from ..loading import streaming
from ..sharding.mesh import mesh_shape_for
from ..sharding.plan import Plan, build_plan
from . import wrap as wrapping
from .empty import parameters_on_meta
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
    """Step 1: config and an empty model of the right class (no weights read)."""
    from transformers import AutoConfig

    config, unused = AutoConfig.from_pretrained(
        path, trust_remote_code=opts.trust_remote_code, return_unused_kwargs=True,
        **opts.hub_kwargs, **opts.config_kwargs)
    if unused:
        raise TypeError(
            f"from_pretrained() got unexpected keyword argument(s) {sorted(unused)}: they are "
            "neither AutoXLA options (sharding_strategy, mesh, auto_shard, use_fsdp_wrap, "
            "auto_wrap_policy, shard_output_callable, gradient_checkpointing, verbose, dtype, "
            "attn_implementation) nor fields of the model's config; check the spelling")
    config._attn_implementation = opts.attn_implementation
    return empty_model(config, auto_class, opts.dtype, opts.trust_remote_code)


def empty_model(config, auto_class, dtype="auto", trust_remote_code: bool = False) -> Resolved:
    """The model of ``config`` with parameters on meta and buffers on the CPU, and its ties.

    Shared by from_pretrained and ``autoxla plan``, so the plan a user previews is the plan the
    loader executes.
    """
    dtype = resolve_dtype(dtype, config)
    with parameters_on_meta():
        model = auto_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.eval()
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


def make_plan(resolved: Resolved, opts: LoadOptions):
    """Step 2: the mesh and the plan of every tensor on it."""
    if opts.mesh is not None:
        shape, mesh, strategy = backend.check_user_mesh(opts.mesh), opts.mesh, "custom mesh"
    else:
        shape = mesh_shape_for(opts.sharding_strategy, backend.device_count())
        mesh, strategy = backend.make_mesh(shape), opts.sharding_strategy
    plan = build_plan(resolved.model, resolved.config, shape, strategy, resolved.dtype, resolved.tied)
    return plan, mesh


def load(model: nn.Module, plan: Plan, mesh, checkpoint: ckpt.Checkpoint, verbose: bool = False) -> None:
    """Step 3: stream every tensor from the checkpoint into its sharded place on the devices."""
    state = ckpt.load_pickle_state(checkpoint.pickle_files) if checkpoint.is_pickle else None
    available = set(state) if state is not None else set(checkpoint.records)
    prefix = getattr(model, "base_model_prefix", "") + "."
    sources, missing = {}, []
    for t in plan:
        if t.tied_to or not t.persistent:
            continue
        key = _checkpoint_key(t.name, available, prefix)
        if key is None and not t.is_buffer:
            missing.append(t.name)
        sources[t.name] = key
    if missing:
        raise ckpt.CheckpointError(
            f"{len(missing)} weight(s) of {plan.model_class} are not in {checkpoint.directory}: "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}. The checkpoint does not match its "
            "config (wrong model class, revision or subfolder?): re-save it with save_pretrained")
    unexpected = available - {k for k in sources.values() if k}
    if unexpected:
        logger.warning("ignoring %d checkpoint tensor(s) the model does not have: %s",
                       len(unexpected), sorted(unexpected)[:5])
    progress = _progress(plan, verbose)
    in_flight = 0
    for t in plan:
        if t.tied_to:
            continue
        key = sources.get(t.name)
        owner, leaf = _owner(model, t.name)
        dtype = getattr(torch, t.dtype)
        if key is None:   # computed buffer (or a persistent one the checkpoint lacks)
            value = streaming.tensor_to_device(owner._buffers[leaf], t.spec, mesh, dtype)
        elif state is not None:
            _check_shape(t, tuple(state[key].shape), key)
            value = streaming.tensor_to_device(state.pop(key), t.spec, mesh, dtype)
        else:
            record = checkpoint.records[key]
            _check_shape(t, record.shape, key)
            shards = streaming.shard_grid_tensors(record, backend.shard_grid(t.spec, mesh), dtype)
            value = streaming.to_device(shards, t.spec, mesh, t.shape)
            del shards
        # Copies to the devices are asynchronous and keep their host shards (the tensor in its
        # load dtype) alive: wait once _WAIT_BYTES are in flight, whichever path made them.
        in_flight += t.nbytes
        if in_flight >= _WAIT_BYTES:
            backend.wait_for_transfers()
            in_flight = 0
        _assign(owner, leaf, value, t.is_buffer)
        progress.update(1)
    progress.close()
    for target, source in plan_ties(plan).items():
        owner, leaf = _owner(model, target)
        src_owner, src_leaf = _owner(model, source)
        setattr(owner, leaf, getattr(src_owner, src_leaf))
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise RuntimeError(f"internal error: {left[:5]} were planned but not loaded; please report")


def plan_ties(plan: Plan) -> dict[str, str]:
    return {t.name: t.tied_to for t in plan if t.tied_to}


def _checkpoint_key(name: str, available: set[str], prefix: str) -> str | None:
    if name in available:
        return name
    # A base-model checkpoint ("layers.0...") loaded into a model with a head ("model.layers.0...").
    if prefix != "." and name.startswith(prefix) and name[len(prefix):] in available:
        return name[len(prefix):]
    return None


def _check_shape(t, shape, key) -> None:
    if tuple(shape) != tuple(t.shape):
        raise ckpt.CheckpointError(
            f"checkpoint tensor {key!r} has shape {tuple(shape)} but the model's {t.name!r} needs "
            f"{tuple(t.shape)}: the checkpoint and its config.json disagree; re-save the checkpoint "
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


def _progress(plan: Plan, verbose: bool):
    from tqdm.auto import tqdm

    return tqdm(total=sum(1 for t in plan if not t.tied_to), desc="AutoXLA: loading",
                unit="tensor", disable=not verbose)


def build(path, auto_class, opts: LoadOptions) -> nn.Module:
    """from_pretrained, top to bottom."""
    resolved = resolve(path, auto_class, opts)                                       # 1. resolve
    checkpoint = ckpt.locate(path, use_safetensors=opts.use_safetensors, **opts.hub_kwargs)
    plan, mesh = make_plan(resolved, opts)                                           # 2. plan
    if opts.verbose:
        print(plan)
    model = resolved.model
    load(model, plan, mesh, checkpoint, opts.verbose)                                # 3. load
    # 4. patch: eager attention only for now (attention kernels and quantized linears come later).
    model = wrapping.wrap(model, plan, mesh, opts)                                   # 5. wrap
    backend.set_global_mesh(mesh)
    return model
