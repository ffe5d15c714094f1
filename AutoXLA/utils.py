"""``AutoXLA.utils``: the original AutoXLA's helper module, here ``prepare_model_for_checkpoint``.

The original moved the model to the CPU in place, unwrapped its attention wrappers and cast it to
the embedding dtype. Here the model AutoXLA loaded is left as it is (sharded, still usable), and a
new, plain transformers model on the CPU is returned, built from the same config with eager
attention and holding the gathered weights. The gathering is save_pretrained's own
(AutoXLA/saving/pretrained.py ``saved_tensors``: the full tensors behind the shards, a scanned
decoder stack under its per-layer names, FSDPv2's wrapper names removed, tied weights once);
dequantizing is the quantized modules' own arithmetic (AutoXLA/quantization/packing.py
``dequantize``).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from . import saving
from .modeling.empty import parameters_on_meta
from .quantization import ModelQuantizer
from .quantization.packing import dequantize as dequantize_weight
from .state import state_of

__all__ = ["prepare_model_for_checkpoint"]


def prepare_model_for_checkpoint(model: nn.Module, dequantize: bool = True) -> nn.Module:
    """A plain transformers copy of ``model`` on the CPU, ready for transformers' own
    ``save_pretrained`` / ``push_to_hub``.

    The copy has unsharded weights, the decoder layers as a ``ModuleList`` again if AutoXLA scanned
    them, eager attention and no AutoXLA hooks (its ``generate`` is transformers'). With
    ``dequantize=True`` every quantized linear becomes an ``nn.Linear`` holding its dequantized
    weight, in the model's float dtype (what the quantized model computes with). With
    ``dequantize=False`` the quantized linears stay quantized: such a copy saves only through
    AutoXLA's ``save_pretrained`` (which it has), since transformers knows no such layers.
    ``model`` itself is not changed.
    """
    inner = saving.unwrap(model)
    config = getattr(inner, "config", None)
    if config is None or not hasattr(type(inner), "_from_config"):
        raise TypeError(f"prepare_model_for_checkpoint needs a transformers model, got "
                        f"{type(inner).__name__}; a model built in code saves with AutoXLA's "
                        "model.save_pretrained(directory)")
    report = state_of(inner).quantization
    dtype = _float_dtype(inner)
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"      # transformers' setter covers the sub-configs too
    if dequantize and hasattr(config, "quantization_config"):
        del config.quantization_config       # an AutoXLA checkpoint's: transformers cannot load it
    with parameters_on_meta():               # parameters come from the model, buffers computed
        plain = type(inner)._from_config(config, dtype=dtype)
    plain.eval()
    if report is not None and not dequantize:
        _quantize_like(plain, report)

    state = {name: t.detach().to("cpu") for name, t in saving.saved_tensors(inner).items()}
    if report is not None and dequantize:
        for name, d in report.layers.items():
            q, scale = state.pop(f"{name}.weight"), state.pop(f"{name}.weight_scale")
            zero_point = state.pop(f"{name}.weight_zero_point", None)
            offset = state.pop(f"{name}.weight_offset", None)
            w = dequantize_weight(q, scale, zero_point, d.fmt, dtype, offset)
            if d.experts:     # the experts module's [experts, ...] parameter, in its own layout
                owner, _, leaf = name.rpartition(".")
                state[name] = w.transpose(1, 2) if plain.get_submodule(owner).is_transposed else w
            else:       # a Conv1D's back in its (in, out) layout
                state[f"{name}.weight"] = w.t().contiguous() if d.transposed else w
    _, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise RuntimeError(f"internal error: {type(inner).__name__} holds {unexpected[:5]}, which "
                           "its transformers class has no place for; please report")
    plain.tie_weights()
    left = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()]
            if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"internal error: {left[:5]} were not gathered from the model; please "
                           "report")
    generation = getattr(inner, "generation_config", None)
    if generation is not None:
        plain.generation_config = copy.deepcopy(generation)
    return plain


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its input embedding's, else its first float tensor's."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embedding, "weight", None)
    if weight is not None and weight.is_floating_point():
        return weight.dtype
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return floating[0] if floating else torch.float32


def _quantize_like(plain: nn.Module, report) -> None:
    """The same layers quantized as in the loaded model (empty, on meta: the loaded model's
    quantized tensors fill them), with a CPU backend."""
    tied = plain.get_expanded_tied_weights_keys(all_submodels=True)
    ModelQuantizer(report.config).quantize_model(plain, tied=tied, on_tpu=False)
    chosen = set(state_of(plain).quantization.layers)
    if chosen != set(report.layers):
        raise RuntimeError(f"internal error: quantizing the CPU copy chose {len(chosen)} layers, "
                           f"the model has {len(report.layers)} quantized; please report")
