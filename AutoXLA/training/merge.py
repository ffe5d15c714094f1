"""A saved LoRA adapter merged into its base checkpoint on disk, on the host, one weight at a
time (``autoxla merge``, ``autoxla finetune --merge``): W + scaling B A for every adapted
projection, added in float32 to the weight as the checkpoint stores it, then written in the
checkpoint's dtype or quantized again (modeling/offline.py's rewrite: the loader's steps, the C
engine's quantizer, the journaled save). No devices and no model in memory: a base too big to
hold in float on the devices merges in about two of its largest tensors of host memory, on
either runtime's interpreter, and a QLoRA run's adapter merges into the float checkpoint its
base was quantized from.

``merge_and_save`` (training/lora.py) is the other way: a float model already on the devices,
merged there and saved.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..modeling.offline import rewrite_checkpoint

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ROWS_ELEMENTS = 1 << 18     # elements of the update made at once (1 MiB in float32)


@dataclass
class LoraUpdate:
    """One projection's merge: ``W + scaling * B @ A`` (``.T`` for a Conv1D-style
    fan_in_fan_out weight), made when its weight is written. ``base``: the whole weight peft
    saved with the adapter (an adapted lm_head or embedding: peft loads it over the model's),
    taken in place of the checkpoint's."""
    a: torch.Tensor             # [r, in]
    b: torch.Tensor             # [out, r]
    scaling: float
    fan_in_fan_out: bool
    base: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        out, inp = self.b.shape[0], self.a.shape[1]
        return (inp, out) if self.fan_in_fan_out else (out, inp)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        w = weight if self.base is None else self.base.to(torch.float32)
        a, b = self.a.to(torch.float32), self.b.to(torch.float32)
        rows = max(1, ROWS_ELEMENTS // w.shape[1])
        # a block of rows at a time: the update never exists whole beside the weight (peft's
        # (B A) * scaling, then added, block by block: the same float32 roundings)
        for start in range(0, w.shape[0], rows):
            part = slice(start, start + rows)
            delta = a[:, part].T @ b.T if self.fan_in_fan_out else b[part] @ a
            w[part].add_(delta.mul_(self.scaling))
        return w


def merge_checkpoint(base, adapter, out, quantization_config=None, dtype="auto",
                     max_shard_size="2GB", overwrite: bool = False,
                     progress: bool | None = None) -> Path:
    """The float safetensors checkpoint directory ``base`` with the LoRA adapter directory
    ``adapter`` (peft's format: ``save_adapter``, ``autoxla finetune``'s OUT/adapter, or any peft
    LoRA adapter of this architecture) merged in, written to the new or empty directory ``out``
    (float in the checkpoint's dtype, or quantized by ``quantization_config``), with the base's
    tokenizer files; returns ``out`` as a Path. transformers and from_pretrained load it.
    ``overwrite``: replace the checkpoint in an ``out`` that is not empty (as `autoxla
    quantize --overwrite`: other files in it are kept)."""
    check_float_base(base)
    updates = read_lora_updates(adapter)
    return rewrite_checkpoint(base, out, quantization_config, updates, dtype=dtype,
                              max_shard_size=max_shard_size, overwrite=overwrite,
                              progress=progress)


def read_lora_updates(adapter) -> dict[str, LoraUpdate]:
    """The adapter's updates by the base tensor each adds to (``...q_proj.weight``); what cannot
    be merged as W + scaling B A is refused by name."""
    from peft import PeftConfig
    from peft.utils.other import get_pattern_key
    from safetensors.torch import load_file

    adapter = Path(adapter)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter / name).is_file():
            raise FileNotFoundError(f"{adapter} has no {name}: not an adapter saved in peft's "
                                    "format (save_adapter, or autoxla finetune's OUT/adapter)")
    config = PeftConfig.from_pretrained(str(adapter))
    where = adapter / ADAPTER_WEIGHTS
    if getattr(config, "peft_type", None) != "LORA":
        raise ValueError(f"{adapter / ADAPTER_CONFIG} is a {config.peft_type} adapter; only LoRA "
                         "adapters merge as W + scaling B A")
    if getattr(config, "use_dora", False):
        raise ValueError(f"{adapter / ADAPTER_CONFIG} has use_dora: DoRA's magnitude vector does "
                         "not merge here; merge it with peft (merge_and_unload)")
    if getattr(config, "modules_to_save", None):
        raise ValueError(f"{adapter / ADAPTER_CONFIG} has modules_to_save "
                         f"{config.modules_to_save}: whole modules trained beside the adapters "
                         "do not merge here; merge it with peft (merge_and_unload)")
    saved = load_file(str(where))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in saved.items():
        name = key.removeprefix("base_model.model.")
        if name.endswith(".base_layer.weight"):   # peft's copy of an adapted head's weight
            pairs.setdefault(name.removesuffix(".base_layer.weight"), {})["base"] = value
            continue
        module, _, part = name.rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise ValueError(f"{where}: {key} is not a LoRA A or B weight (an embedding adapter "
                             "or another kind), which does not merge here; merge it with peft")
        pairs.setdefault(module, {})[part[0]] = value
    updates = {}
    for module, ab in pairs.items():
        if "A" not in ab or "B" not in ab:
            have = " and ".join(f"lora_{k}" if k != "base" else "a base weight" for k in ab)
            missing = " and ".join(f"lora_{k}" for k in ("A", "B") if k not in ab)
            raise ValueError(f"{where} has {have} but no {missing} for {module}: the file is "
                             "incomplete")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{where}: {module}'s lora_A {list(a.shape)} and lora_B "
                             f"{list(b.shape)} are not [r, in] and [out, r]")
        r = a.shape[0]             # rank_pattern may give each module its own
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern, module),
                                         config.lora_alpha)
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        update = LoraUpdate(a, b, scaling, bool(config.fan_in_fan_out), ab.get("base"))
        if update.base is not None and tuple(update.base.shape) != update.shape:
            raise ValueError(f"{where}: {module}'s saved base weight is "
                             f"{list(update.base.shape)}, its adapter makes {list(update.shape)}")
        updates[f"{module}.weight"] = update
    if not updates:
        raise ValueError(f"{where} holds no LoRA weights")
    return updates


def check_float_base(base) -> None:
    """A quantized checkpoint cannot take a LoRA adapter's float update: the float checkpoint it
    was quantized from can (said before anything is read or written)."""
    config = Path(base) / "config.json"
    if config.is_file() and "quantization_config" in json.loads(config.read_text()):
        raise ValueError(
            f"{base} is a quantized checkpoint (its config.json has quantization_config), which "
            "cannot take a LoRA adapter's float update: merge into the float checkpoint it was "
            "quantized from, with --bits (quantization_config) to quantize the result again; to "
            "fine-tune quantized, fine-tune that float checkpoint with --bits")
