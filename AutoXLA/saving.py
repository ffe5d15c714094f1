"""save_pretrained for AutoXLA models: sharded or not, quantized or not, written atomically.

The directory is a normal transformers checkpoint (config.json + safetensors shards + index) whose
config.json also holds ``quantization_config`` when the model is quantized, so
``from_pretrained(dir)`` loads the quantized tensors as they are, without quantizing again.

A save never leaves a half-written checkpoint that loads: every file is first written under a
temporary name and fsync'ed; then config.json (what makes a directory loadable) is moved aside,
the weight files are renamed into place, and the new config.json is renamed in last. A process
killed at any point leaves either the complete new checkpoint, or a directory without config.json
that from_pretrained refuses (the previous config is kept as config.json.autoxla-previous). Files
that are not ours (tokenizer, README) are never touched.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

import torch
from torch import nn

from .loading.checkpoint import SAFE_INDEX, SAFE_SINGLE
from .sharding.plan import persistent_buffer_names

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
_PREVIOUS = ".autoxla-previous"
_FSDP_WRAPPED = "_orig_module."
_DEFAULT_SHARD = 2 * 2**30
_TEMPORARY = re.compile(r"^\.(.+)\.tmp-[0-9a-f]{8}$")   # stage() names: .{final}.tmp-{token}


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside an FSDPv2 wrapper (or the model itself)."""
    return getattr(model, "autoxla_module", None) or model


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
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
        inside = [n.replace(_FSDP_WRAPPED, "").startswith(stacked) for n, _ in named]
        at = inside.index(True) if True in inside else len(named)
        rest = [item for item, skip in zip(named, inside) if not skip]
        named = rest[:at] + list(m.per_layer_items(f"{prefix}." if prefix else "")) + rest[at:]
    return named


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = str(size).strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[:-len(unit)]) * units[unit])
    raise ValueError(f"max_shard_size={size!r} is not a size; use e.g. '2GB', '500MB' or bytes")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike,
                    max_shard_size: int | str = _DEFAULT_SHARD, **ignored) -> None:
    """Write ``model`` (sharded over XLA devices, or on the CPU) as a checkpoint AutoXLA and
    transformers' config machinery read back; see the module docstring for the atomicity rules."""
    from safetensors.torch import save_file

    inner = unwrap(model)
    target = Path(save_directory)
    if target.exists() and not target.is_dir():
        raise ValueError(f"save_directory {str(target)!r} is a file; pass a directory path")
    target.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size)
    tensors = _tensors(inner)

    # Group tensors into shards by their bytes, in model order.
    groups, current, size = [], [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if current and size + n > limit:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current or not groups:
        groups.append(current)
    names = ([SAFE_SINGLE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])

    token = secrets.token_hex(4)
    staged: list[tuple[Path, Path]] = []   # (temporary, final)

    def stage(final_name: str) -> Path:
        tmp = target / f".{final_name}.tmp-{token}"
        staged.append((tmp, target / final_name))
        return tmp

    try:
        weight_map, total = {}, 0
        for fname, group in zip(names, groups):
            # One shard at a time on the host: an XLA tensor's .cpu() gathers its shards.
            host = {n: tensors[n].detach().to("cpu").contiguous() for n in group}
            total += sum(t.numel() * t.element_size() for t in host.values())
            tmp = stage(fname)
            save_file(host, str(tmp), metadata={"format": "pt"})
            _fsync_file(tmp)
            weight_map.update({n: fname for n in group})
            del host
        if len(names) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_text(stage(SAFE_INDEX), json.dumps(index, indent=2, sort_keys=True) + "\n")
        generation = getattr(inner, "generation_config", None)
        if generation is not None and hasattr(generation, "to_json_string"):
            _write_text(stage(GENERATION_CONFIG), generation.to_json_string())
        _write_text(stage(CONFIG), _config_json(inner))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise

    # Commit. Until the new config.json is in place the directory does not load.
    config = target / CONFIG
    if config.exists():
        os.replace(config, target / (CONFIG + _PREVIOUS))
        _fsync_dir(target)
    new_names = {final.name for _, final in staged}
    ours = {tmp.name for tmp, _ in staged}
    for old in _our_weight_files(target):
        if old.name not in new_names and old.name not in ours:
            old.unlink()
    for tmp, final in staged:
        if final.name != CONFIG:
            os.replace(tmp, final)
    _fsync_dir(target)
    os.replace(target / f".{CONFIG}.tmp-{token}", config)
    _fsync_dir(target)
    (target / (CONFIG + _PREVIOUS)).unlink(missing_ok=True)


def _our_weight_files(d: Path) -> list[Path]:
    """Weight files a previous save (ours or transformers') left, and the temporaries of a save
    that was killed: all replaced by this one."""
    def ours(name: str) -> bool:
        return (name in (SAFE_SINGLE, SAFE_INDEX) or _TEMPORARY.match(name) is not None
                or (name.startswith("model-") and name.endswith(".safetensors")))

    return [p for p in d.iterdir() if p.is_file() and ours(p.name)]


def _config_json(model: nn.Module) -> str:
    config = model.config
    d = json.loads(config.to_json_string(use_diff=False))
    report = getattr(model, "autoxla_quantization", None)
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
