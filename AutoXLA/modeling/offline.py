"""Rewrite a checkpoint on disk, on a CPU host with no XLA devices: quantized (``autoxla
quantize``) and/or with updates added to its weights (a LoRA adapter merged, ``autoxla merge``,
training/merge.py).

The result is what ``from_pretrained(SRC, do_quant=True, quantization_config=cfg)`` followed by
``save_pretrained(DST)`` writes: the same layer choice (ModelQuantizer's plan of the empty model
on the meta device), the same C engine call per weight (quantize_tensor, on the tensor as the
checkpoint stores it, as the loader does), the same tensor names, dtypes, shard grouping and files,
committed by the same journaled save (saving.write_checkpoint). One tensor at a time is read,
updated, quantized or converted, and written at its offset in its shard
(saving/safetensors_out.py), so memory stays within about two tensors of the largest.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Mapping, Protocol

import torch

from .. import _native, saving
from ..loading import execute, streaming
from ..loading import checkpoint as ckpt
from ..planning.plan import build_plan
from ..quantization.linear import linear_rows, stored_tensors
from ..saving.safetensors_out import ShardWriter
from ..sharding.decoder_stack import plan_stack
from ..sharding.mesh import mesh_shape_for
from .causal import causal_or_image_text_class
from .choices import quantization_for
from .empty import load_config
from .pipeline import empty_model, pick_auto_class, quantize_layers
from .segmentation import auto_classes

# Files that are not weights or configs but make a checkpoint usable (its tokenizer): copied from
# SRC when DST has no file of that name (never over a file of DST).
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
              "chat_template.jinja", "chat_template.json")


class Update(Protocol):
    """A change to one weight: its shape (the checkpoint's, [out, in] for a linear), and a call
    that takes the weight in float32 and returns it changed, made when that weight is written
    (one at a time in memory)."""
    shape: tuple[int, ...]

    def __call__(self, weight: torch.Tensor) -> torch.Tensor: ...


def quantize_checkpoint(src, dst, config, dtype="auto", max_shard_size="2GB",
                        overwrite: bool = False, progress: bool | None = None) -> Path:
    """Write the float safetensors checkpoint directory ``src`` quantized by ``config`` (a
    QuantizationConfig) into the directory ``dst``; returns ``dst`` as a Path.

    progress: None = a bar on a terminal only (as the loader shows), True / False = always / never.
    """
    return rewrite_checkpoint(src, dst, config, dtype=dtype, max_shard_size=max_shard_size,
                              overwrite=overwrite, progress=progress)


def rewrite_checkpoint(src, dst, config=None, updates: Mapping[str, Update] | None = None,
                       dtype="auto", max_shard_size="2GB", overwrite: bool = False,
                       progress: bool | None = None) -> Path:
    """``src`` (a float safetensors checkpoint directory) written to ``dst`` with ``updates``
    made to its weights (tensor name -> Update: each on the weight as the checkpoint stores it,
    in float32, before it is quantized or converted) and quantized by ``config`` (a
    QuantizationConfig; None: kept float). Every update is checked against the checkpoint's
    tensors before anything is written. Returns ``dst`` as a Path."""
    src, dst = Path(src), Path(dst)
    _check_dst(src, dst, overwrite)
    resolved = _empty_model(src, dtype)
    checkpoint = ckpt.locate(src)
    if checkpoint.is_pickle:
        raise ValueError(f"{src} holds pickle weights (*.bin), which cannot be read one tensor at "
                         "a time; convert it to safetensors first (load and save_pretrained)")
    # the backend does not change what is stored; the format is chosen as from_pretrained does
    quantize_layers(resolved, quantization_for(resolved.config, config), on_tpu=False)
    model = resolved.model
    # One device: the plan serves for its names, shapes, dtypes and sources, not for its specs.
    plan = build_plan(model, resolved.config, mesh_shape_for("fsdp", 1), "fsdp", resolved.dtype,
                      resolved.tied, scan_layers=False, quantization=resolved.quantization)
    stored = _saved_order(model, saving.saved_tensors(model))   # what save_pretrained stores
    specs = {n: (tuple(t.shape), t.dtype) for n, t in stored.items()}
    groups = saving.shard_groups({n: t.numel() * t.element_size() for n, t in stored.items()},
                                 saving.parse_size(max_shard_size))
    steps = execute.loading_steps(model, plan, checkpoint, only=set(specs))
    updates = dict(updates or {})
    _check_updates(updates, steps, src)

    def write_shards(paths, groups):
        writer = ShardWriter(specs, groups, paths)
        try:
            _stream(steps, checkpoint, writer, updates, progress,
                    "merging" if updates else "quantizing")
        finally:
            writer.close(check=False)
        writer.close()

    dst.mkdir(parents=True, exist_ok=True)
    saving.write_checkpoint(dst, groups, write_shards, saving.config_json(model),
                           saving.generation_json(model))
    _copy_companions(src, dst)
    return dst


def _check_updates(updates: dict, steps, src: Path) -> None:
    """Every update names a weight the checkpoint stores, of its shape: said before writing."""
    weights = {s.tensor.name: s for s in steps if s.key is not None}
    for name, update in updates.items():
        step = weights.get(name)
        if step is None:
            raise ValueError(f"{src} has no weight {name} to update (tied to another tensor, or "
                             "not in this model): the update was made for another model")
        t = step.tensor
        shape = tuple(t.source_shape) if step.quantize else tuple(t.shape)
        if tuple(update.shape) != shape:
            raise ValueError(f"{src}: {name} is {list(shape)}, the update to it is "
                             f"{list(update.shape)}: made for a model of another size")


def _saved_order(model, stored: dict) -> dict:
    """``stored`` in the order save_pretrained writes a loaded model's tensors, which decides the
    shard each lands in. from_pretrained scans a repeating decoder stack (scan_layers=True, the
    default): its save writes each layer's tensors together (parameters, then buffers) where the
    stack stands (saving/pretrained.py _unstacked), where an unscanned model lists every parameter first."""
    stack = plan_stack(model, True)
    if stack is None or not stack.scanned:
        return stored
    prefix = stack.path + "."
    names = list(stored)
    inside = [n for n in names if n.startswith(prefix)]
    if not inside:
        return stored
    at = names.index(inside[0])
    rest = [n for n in names if not n.startswith(prefix)]
    inside.sort(key=lambda n: int(n[len(prefix):].split(".", 1)[0]))   # stable: keeps each layer's order
    return {n: stored[n] for n in rest[:at] + inside + rest[at:]}


def _check_dst(src: Path, dst: Path, overwrite: bool) -> None:
    if not src.is_dir():
        raise FileNotFoundError(f"SRC {src} is not a directory; pass a checkpoint directory "
                                "(config.json and safetensors weights)")
    if not (src / saving.CONFIG).is_file():
        raise FileNotFoundError(f"SRC {src} has no config.json: not a checkpoint directory "
                                "(save_pretrained writes config.json and safetensors weights)")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"DST {dst} is a file; pass a directory for the quantized checkpoint")
    if dst.exists() and os.path.samefile(src, dst):
        raise ValueError(f"DST {dst} is SRC: writing in place would replace the weights it reads; "
                         "pass another directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"DST {dst} exists and is not empty; pass --overwrite to replace the "
                              "checkpoint in it (only config.json, generation_config.json and the "
                              "weight files are replaced, other files are kept) or choose an "
                              "empty directory")


def _empty_model(src: Path, dtype):
    config = load_config(str(src))
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"SRC {src} is already quantized (its config.json has "
                         "quantization_config); quantize its float checkpoint instead")
    auto_class = causal_or_image_text_class(config) or pick_auto_class(auto_classes(), config)
    return empty_model(config, auto_class, dtype)


def _stream(steps, checkpoint, writer: ShardWriter, updates: dict, progress,
            doing: str) -> None:
    """Every stored tensor, as the loader makes it on the host (loading/execute.py's steps, its
    quantizer call and reads), its update made, handed to ``writer`` instead of the devices."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(steps), desc=f"AutoXLA: {doing}", unit="tensor",
               disable=None if progress is None else not progress)
    for step in steps:
        t, key = step.tensor, step.key
        if step.quantize:
            w = execute.read_whole(key, checkpoint)
            execute.check_shape(t, tuple(w.shape), key, expected=t.source_shape)
            if t.name in updates:
                w = _updated(w, updates[t.name], w.dtype)
            q = execute.quantize_weight(step.owner, linear_rows(step.owner, w),
                                        f"{t.name} (checkpoint tensor {key!r})", stats=False)
            del w
            prefix = t.name.rpartition(".")[0]
            for part, value in stored_tensors(q).items():
                writer.write(f"{prefix}.{part}" if prefix else part, value)
            del q
        else:
            dtype = getattr(torch, t.dtype)
            if key is None:   # a persistent buffer the checkpoint lacks: the model's own value
                value = step.owner._buffers[step.leaf].to(dtype)
            else:
                value = execute.read_whole(key, checkpoint)
                execute.check_shape(t, tuple(value.shape), key)
                value = (_updated(value, updates[t.name], dtype) if t.name in updates
                         else _converted(value, dtype))
            writer.write(t.name, value)
            del value
        bar.update(1)
    bar.close()


def _updated(w: torch.Tensor, update: Update, dtype) -> torch.Tensor:
    """``update`` made to ``w`` in float32, stored in ``dtype`` (one rounding, as peft's merge of
    a float32 model; bfloat16 weights round once, after the sum)."""
    return _converted(update(w.to(torch.float32)), dtype)


def _converted(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in the load dtype, by the C core where the loader converts with it (read_shards:
    the same rounding, and the same NaN bits)."""
    if t.dtype == dtype:
        return t
    if t.dtype in streaming.NATIVE_DTYPES and dtype in streaming.NATIVE_DTYPES and t.dim() > 0:
        return _native.convert(t.contiguous(), dtype)
    return t.to(dtype)


def _copy_companions(src: Path, dst: Path) -> None:
    for name in COMPANIONS:
        if (src / name).is_file() and not os.path.lexists(dst / name):
            tmp = dst / f".{name}.autoxla-copy"
            shutil.copyfile(src / name, tmp)
            os.replace(tmp, dst / name)
