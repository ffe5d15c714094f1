"""save_pretrained for AutoXLA models, sharded or not, quantized or not: the model's tensors
under transformers' names (a scanned stack's layers unstacked, FSDPv2's wrapper names dropped),
one shard at a time on the host, written by saving/journal.py's atomic writer (its docstring says
what a save replaces and keeps). The directory is a normal transformers checkpoint whose
config.json also holds ``quantization_config`` when the model is quantized, so
``from_pretrained(dir)`` loads the quantized tensors as they are, without quantizing again."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ..planning.plan import persistent_buffer_names
from ..state import state_of
from .journal import _DEFAULT_SHARD, parse_size, shard_groups, write_checkpoint

# FSDPv2 wraps each decoder layer and keeps it as `_orig_module`: saved names drop it.
_FSDP_WRAPPED = "_orig_module."


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside an FSDPv2 wrapper (or the model itself)."""
    return state_of(model).module or model


def saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer, each storage once (tied weights keep the first name,
    which transformers ties the others to when it loads)."""
    persistent = persistent_buffer_names(model)
    out, seen = {}, set()
    named = list(model.named_parameters(remove_duplicate=False))
    named += [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent]
    named = _unstacked(model, named)
    for name, t in named:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        # FSDPv2 wraps each decoder layer and keeps it as `_orig_module`: save the model's names.
        out[name.replace(_FSDP_WRAPPED, "")] = t
    return out


def _unstacked(model: nn.Module, named: list) -> list:
    """A scanned decoder stack (modeling/scan.py) holds ``[layers, ...]`` tensors: save them under
    the per-layer names transformers' checkpoints use, each layer's slice, where they stood."""
    for prefix, m in model.named_modules():
        if not hasattr(m, "per_layer_items"):
            continue
        # FSDPv2 keeps the wrapped module as `_orig_module`: save the model's own names.
        prefix = ".".join(part for part in prefix.split(".") if part + "." != _FSDP_WRAPPED)
        stacked = f"{prefix}.stacked." if prefix else "stacked."
        # The layers before the loop (plan.start) are whole modules, their buffers listed after
        # every parameter: they move to the stack too, so each layer's tensors stand together, in
        # layer order (the order `autoxla quantize` writes).
        whole = tuple(f"{prefix}.{i}." if prefix else f"{i}." for i in range(m.stack_plan.start))
        names = [n.replace(_FSDP_WRAPPED, "") for n, _ in named]
        inside = [n.startswith(stacked) or n.startswith(whole) for n in names]
        at = inside.index(True) if True in inside else len(named)
        rest = [item for item, skip in zip(named, inside) if not skip]
        head = [item for item, n in zip(named, names) if n.startswith(whole)]
        named = (rest[:at] + head + list(m.per_layer_items(f"{prefix}." if prefix else ""))
                 + rest[at:])
    return named

def save_pretrained(model: nn.Module, save_directory: str | os.PathLike,
                    max_shard_size: int | str = _DEFAULT_SHARD, **ignored) -> None:
    """Write ``model`` (sharded over XLA devices, DTensors over the dtensor runtime's processes,
    or on the CPU) as a checkpoint AutoXLA and transformers' config machinery read back. On the
    dtensor runtime every process calls it (a collective); process 0 writes. It replaces config.json, generation_config.json,
    model.safetensors, the index and the files the previous index names, and nothing else; a
    failure leaves the previous checkpoint (module docstring for the exact rules)."""
    from safetensors.torch import save_file

    inner = unwrap(model)
    target = Path(save_directory)
    if target.exists() and not target.is_dir():
        raise ValueError(f"save_directory {str(target)!r} is a file; pass a directory path")
    limit = parse_size(max_shard_size)
    target.mkdir(parents=True, exist_ok=True)
    tensors = saved_tensors(inner)
    groups = shard_groups({n: t.numel() * t.element_size() for n, t in tensors.items()}, limit)

    def write(copies) -> None:
        """Called where the files are written; ``copies`` yields each group's whole tensors."""
        def write_shards(paths: list[Path], groups: list[list[str]]) -> None:
            for path, host in zip(paths, copies):
                save_file(host, str(path), metadata={"format": "pt"})
                del host

        write_checkpoint(target, groups, write_shards, config_json(inner), generation_json(inner))

    # The dtensor runtime gathers each tensor over its processes and writes on one of them
    # (runtimes/dtensor/saving.py); on one process the tensors are copied here.
    writer = getattr(state_of(inner).runtime, "write_whole", None) or write_whole_here
    writer(tensors, groups, write)


def write_whole_here(tensors: dict[str, torch.Tensor], groups: list[list[str]], write) -> None:
    """``write`` with each group's tensors on the host, one group at a time (an XLA tensor's
    .cpu() gathers its shards)."""
    write({n: tensors[n].detach().to("cpu").contiguous() for n in group} for group in groups)


def generation_json(model: nn.Module) -> str | None:
    """The model's generation_config.json text, or None when it has none."""
    generation = getattr(model, "generation_config", None)
    return generation.to_json_string() if hasattr(generation, "to_json_string") else None


def config_json(model: nn.Module) -> str:
    config = model.config
    d = json.loads(config.to_json_string(use_diff=False))
    report = state_of(model).quantization
    if report is not None:
        d["quantization_config"] = report.config.to_dict()
    else:
        d.pop("quantization_config", None)
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def attach(model: nn.Module) -> nn.Module:
    """Give ``model`` (and the transformers model inside a wrapper) AutoXLA's save_pretrained."""
    def bound(save_directory, **kwargs):
        return save_pretrained(model, save_directory, **kwargs)

    bound.__doc__ = save_pretrained.__doc__
    model.save_pretrained = bound
    return model
