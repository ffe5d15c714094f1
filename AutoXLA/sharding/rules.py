"""Tensor role -> partition spec (DESIGN.md section 3).

Roles come from the module type and position; names are only hints for which side of a
column/row pair a linear sits on. Specs follow the Megatron convention on the mesh axes
("data", "fsdp", "model"): a column-parallel linear followed by a row-parallel one needs a single
all-reduce. Weights are never split over "data" (3d replicates them there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .mesh import MeshShape, format_spec

# Name hints (the last component of the module path).
COLUMN_NAMES = frozenset({
    "q_proj", "k_proj", "v_proj", "qkv_proj", "qkv", "query", "key", "value", "query_key_value",
    "gate_proj", "up_proj", "gate_up_proj", "fc1", "lin1", "linear1", "w1", "w3", "c_fc",
    "wi", "wi_0", "wi_1", "dense_h_to_4h", "c_attn", "in_proj",
    "linear_1",   # vision-language projectors (Mistral 3, LLaVA): linear_1 -> act -> linear_2
    "layer1",     # SAM 3's DETR heads and scoring MLP: layer1 -> relu -> layer2 [-> layer3]
})
# Column linears that compute several projections in one output (q, k and v; gate and up) which
# the model slices by position: a split of that output is not a split of each projection, so the
# dtensor runtime computes their modules whole (runtimes/dtensor/execute.py); under GSPMD any
# split is only a layout.
FUSED_COLUMN_NAMES = frozenset({"qkv_proj", "qkv", "query_key_value", "gate_up_proj", "c_attn",
                                "in_proj"})
ROW_NAMES = frozenset({
    "o_proj", "out_proj", "down_proj", "fc2", "lin2", "linear2", "w2", "proj", "dense_4h_to_h",
    "c_proj", "wo",
    "linear_2", "layer2",
})
# Which config field counts the heads a projection holds (split by whole heads only).
_HEAD_FIELDS = {
    "q_proj": "num_attention_heads", "query": "num_attention_heads",
    "k_proj": "num_key_value_heads", "key": "num_key_value_heads",
    "v_proj": "num_key_value_heads", "value": "num_key_value_heads",
    "o_proj": "num_attention_heads",
}

COLUMN, ROW, LINEAR = "column_linear", "row_linear", "linear"
EMBEDDING, LM_HEAD, NORM, BIAS = "vocab_embedding", "lm_head", "norm", "bias"
CONV, BUFFER, OTHER = "conv", "buffer", "other"
EXPERTS = "experts"
SCALE = "quant_scale"
# Buffers of a quantized linear that sit beside its weight (quantization/linear.py).
QUANT_SIDECARS = frozenset({"weight_scale", "weight_zero_point", "weight_offset"})


@dataclass(frozen=True)
class Rule:
    """A role and the spec it asks for, before divisibility is checked."""

    role: str
    spec: tuple
    heads: tuple | None = None  # (dim, head count) when the dim must split by whole heads
    fallback: tuple | None = None   # the spec to use when ``spec`` would replicate a dimension


def classify(name: str, tensor: torch.Tensor, module: nn.Module, output_embedding: nn.Module | None,
             config, is_buffer: bool) -> Rule:
    """The rule for one parameter or buffer named ``name`` owned by ``module``."""
    leaf = name.rsplit(".", 1)[-1]
    mod_name = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    rank = tensor.dim()
    quantized = getattr(module, "quant_format", None) is not None
    if is_buffer and not quantized:
        return Rule(BUFFER, (None,) * rank)
    if isinstance(module, nn.Embedding) and leaf == "weight":
        return Rule(EMBEDDING, ("fsdp", "model"))   # float, or int8 (quantization/embedding.py)
    if isinstance(module, nn.Embedding) and leaf in QUANT_SIDECARS:
        return Rule(SCALE, ("fsdp", None))   # an int8 table's per-row scale follows its vocab split
    if quantized and getattr(module, "num_experts", None):     # QuantizedExperts
        return _quantized_experts_rule(mod_name, leaf, module.quant_format.groups)
    if isinstance(module, nn.Linear) or quantized:
        if leaf in QUANT_SIDECARS:
            return _sidecar_rule(_linear_rule("weight", mod_name, module is output_embedding, config),
                                 module.quant_format.groups)
        return _linear_rule(leaf, mod_name, module is output_embedding, config)
    if is_experts(module) and leaf in _EXPERT_SPECS:
        return _experts_rule(EXPERTS, _EXPERT_SPECS[leaf][bool(module.is_transposed)])
    if isinstance(module, nn.modules.conv._ConvNd) and leaf == "weight":
        return Rule(CONV, ("fsdp",) + (None,) * (rank - 1))
    if rank == 1 and ("norm" in type(module).__name__.lower() or "norm" in mod_name.lower()
                      or mod_name.lower().startswith("ln")):
        return Rule(NORM, ("fsdp",))
    if rank == 0:
        return Rule(OTHER, ())
    # Anything else: FSDP on the largest dim, as FSDPv2 itself would do.
    spec = [None] * rank
    spec[max(range(rank), key=lambda d: tensor.shape[d])] = "fsdp"
    return Rule(OTHER, tuple(spec))


# Expert parallelism: a mixture-of-experts layer's [experts, ...] tensors are split by expert over
# fsdp, the axis that also splits the batch (GShard's layout: tokens go to their experts' devices
# and come back across that one axis), and by the hidden dim over model, the dim activations are
# split on there. (not transposed, transposed) specs: weights [E, out, in] / [E, in, out].
_EXPERT_SPECS = {
    "gate_up_proj": (("fsdp", None, "model"), ("fsdp", "model", None)),
    "up_proj": (("fsdp", None, "model"), ("fsdp", "model", None)),
    "down_proj": (("fsdp", "model", None), ("fsdp", None, "model")),
    "gate_up_proj_bias": (("fsdp", None), ("fsdp", None)),
    "up_proj_bias": (("fsdp", None), ("fsdp", None)),
    "down_proj_bias": (("fsdp", "model"), ("fsdp", "model")),
}


def _experts_rule(role: str, spec: tuple) -> Rule:
    # Fewer experts than fsdp devices (Mixtral's 8 on 64): FSDP's split of the other dimension
    # instead, so no device holds every expert whole.
    fallback = (None,) + tuple("fsdp" if a is None else a for a in spec[1:]) if len(spec) == 3 else None
    return Rule(role, spec, fallback=fallback)


def _quantized_experts_rule(projection: str, leaf: str, groups: int) -> Rule:
    """A QuantizedExperts tensor (quantization/experts.py, always stored [E, out, in]): the weight
    as the float projection's, its scales and zero points [E, out, groups] split the same way
    but on the input dim only when there is more than one group (blockwise)."""
    spec = _EXPERT_SPECS[projection][False]
    if leaf in QUANT_SIDECARS:
        return _experts_rule(SCALE, spec[:2] + (spec[2] if groups > 1 else None,))
    return _experts_rule(EXPERTS, spec)


def is_experts(module: nn.Module) -> bool:
    """A transformers 5 experts module (its ``@use_experts_implementation`` decorator sets
    these flags): one [experts, ...] parameter per projection."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and not isinstance(
        module, nn.Linear)


def _linear_rule(leaf: str, mod_name: str, is_head: bool, config) -> Rule:
    """A linear's weight (out, in) or bias (out,); a quantized weight (int8 or packed int4, same
    dims) takes the same spec as the float one it replaces (DESIGN.md section 3)."""
    if is_head:
        return Rule(LM_HEAD, ("model", "fsdp") if leaf == "weight" else ("model",))
    heads = _head_count(mod_name, config)
    if mod_name in COLUMN_NAMES:
        if leaf == "weight":
            return Rule(COLUMN, ("model", "fsdp"), (0, heads) if heads else None)
        return Rule(BIAS, ("model",), (0, heads) if heads else None)
    if mod_name in ROW_NAMES:
        if leaf == "weight":
            return Rule(ROW, ("fsdp", "model"), (1, heads) if heads else None)
        return Rule(BIAS, ("fsdp",))
    # An unrecognised linear gets plain FSDP on its output dim: always correct, never clever.
    return Rule(LINEAR, ("fsdp", None) if leaf == "weight" else ("fsdp",))


def _sidecar_rule(weight: Rule, groups: int) -> Rule:
    """Scales and zero points (out, groups) follow the weight's output split, and its input split
    when there is more than one group (blockwise)."""
    heads = weight.heads if weight.heads and weight.heads[0] == 0 else None
    return Rule(SCALE, (weight.spec[0], weight.spec[1] if groups > 1 else None), heads)


def _head_count(mod_name: str, config) -> int | None:
    field = _HEAD_FIELDS.get(mod_name)
    if field is None or config is None:
        return None
    value = getattr(config, field, None)
    if value is None and field == "num_key_value_heads":
        value = getattr(config, "num_attention_heads", None)
    return value if isinstance(value, int) and value > 0 else None


def resolve_spec(rule: Rule, shape: tuple[int, ...], mesh: MeshShape) -> tuple[tuple, list[str]]:
    """The rule's spec made legal for ``shape`` on ``mesh``, and the reasons for what it dropped.

    Axes of size 1 are dropped (they split nothing); a dimension that its axes do not divide, or a
    projection whose heads they do not divide, is replicated on them and the reason is kept. A
    rule with a fallback takes it when its own spec replicates something the fallback splits.
    """
    spec, reasons = _legal_spec(rule, shape, mesh)
    if reasons and rule.fallback is not None:
        other, other_reasons = _legal_spec(Rule(rule.role, rule.fallback), shape, mesh)
        if _split_ways(other, mesh) > _split_ways(spec, mesh):
            why = "; ".join(r.removeprefix("replicated on ").split(": ", 1)[-1] for r in reasons)
            return other, [f"{why}: split as {format_spec(other)} instead"] + other_reasons
    return spec, reasons


def _split_ways(spec: tuple, mesh: MeshShape) -> int:
    ways = 1
    for axes in spec:
        if axes is not None:
            ways *= mesh.size(axes)
    return ways


def _legal_spec(rule: Rule, shape: tuple[int, ...], mesh: MeshShape) -> tuple[tuple, list[str]]:
    spec, reasons = [], []
    for dim, axes in enumerate(rule.spec):
        if axes is None:
            spec.append(None)
            continue
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        names = tuple(a for a in names if mesh.size(a) > 1)
        size = mesh.size(names)
        if not names:
            spec.append(None)
            continue
        if rule.heads is not None and rule.heads[0] == dim and rule.heads[1] % size:
            reasons.append(f"replicated on {'+'.join(names)}: {rule.heads[1]} heads do not divide "
                           f"{'x'.join(names)}={size}")
            spec.append(None)
            continue
        if shape[dim] % size:
            reasons.append(f"replicated on {'+'.join(names)}: dim {dim} ({shape[dim]}) does not "
                           f"divide {'x'.join(names)}={size}")
            spec.append(None)
            continue
        spec.append(names[0] if len(names) == 1 else names)
    return tuple(spec), reasons


def batch_axes(mesh: MeshShape, batch_size: int | None = None):
    """Axes that split the batch dimension of activations, inputs and outputs.

    Listed fsdp first: on a 3d mesh, activations annotated (("data", "fsdp"), None, "model")
    come out wrong for rows placed on some devices (torch_xla 2.9 on XLA:CPU, measured: rows 1
    and 2 of a batch of 4 differ from transformers by ~7 in the logits), while ("fsdp", "data")
    is exact; tests/modeling/test_causal_sharded.py keeps a batch that splits over both axes."""
    names = tuple(a for a in ("fsdp", "data") if mesh.size(a) > 1)
    if not names or (batch_size is not None and batch_size % mesh.size(names)):
        return None
    return names[0] if len(names) == 1 else names
