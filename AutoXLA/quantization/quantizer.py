"""ModelQuantizer: swaps a model's nn.Linear layers for QuantizedLinear, its mixture-of-experts
projections ([experts, ...] parameters) for QuantizedExperts, and, with quantize_embeddings, its
nn.Embedding tables for QuantizedEmbedding.

Works on a model whose weights are on the meta device (the loader's case: the swap happens before
any weight is read, and the loader fills the quantized buffers from the C engine as it streams),
on the CPU, or on an XLA device (weights are quantized on the host by the C engine and put back on
the device they came from). Biases stay in full precision.
"""
from __future__ import annotations

import logging

from torch import nn

from .. import moe, saving
from ..module_swap import repointing_references
from ..state import record_state
from . import sensitivity
from .calibration import CalibrationConfig
from .config import QuantizationConfig
from .decisions import LayerDecision, QuantizationReport, decide
from .embedding import GATHER, QuantizedEmbedding
from .experts import QuantizedExperts, quantize_experts
from .linear import QuantizedLinear, linear_rows, stored_tensors
from .weights import quantize_tensor

logger = logging.getLogger("AutoXLA")


def _weight_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def get_model_size(model: nn.Module) -> dict[str, float]:
    """The model's bytes in MiB, as the original reports them: ``param_size_mb`` (parameters),
    ``buffer_size_mb`` (all buffers, quantized weights and scales included, computed ones too)
    and ``total_size_mb``; a tensor shared by two names counts once. Works on the meta device."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"param_size_mb": params / 2**20, "buffer_size_mb": buffers / 2**20,
            "total_size_mb": (params + buffers) / 2**20}


class ModelQuantizer:
    """``ModelQuantizer(config).quantize_model(model) -> model`` (also ``LanguageModelQuantizer``)."""

    get_model_size = staticmethod(get_model_size)

    def __init__(self, config: QuantizationConfig | None = None, **kwargs):
        if config is None:
            config = QuantizationConfig(**kwargs)
        elif kwargs:
            raise TypeError("pass either a QuantizationConfig or its keywords, not both")
        if not isinstance(config, QuantizationConfig):
            raise TypeError(f"config must be a QuantizationConfig, got {type(config).__name__}; "
                            "build one with QuantizationConfig(n_bits=8, ...)")
        self.config = config

    def plan(self, model: nn.Module, tied: dict[str, str] | None = None,
             on_tpu: bool | None = None) -> QuantizationReport:
        """Decide, without changing the model, which linears are quantized and how
        (decisions.py)."""
        return decide(self.config, model, tied, on_tpu)

    def quantize_model(self, model: nn.Module, tied: dict[str, str] | None = None,
                       on_tpu: bool | None = None, calibration=None, tokenizer=None) -> nn.Module:
        """Replace the chosen nn.Linear layers (and embedding tables) in place; returns ``model``.

        ``calibration`` (a CalibrationConfig, True, text, token ids or a Calibration; text needs
        ``tokenizer``) first calibrates the float model: SmoothQuant for W8A8, the per-layer
        sensitivity report and, with a target, auto-exclusion (docs/quantization.md).
        The report is ``model.autoxla_quantization`` (and is logged).
        """
        cal = CalibrationConfig.from_any(calibration)
        _refuse_stacked(model)
        config, result = self.config, None
        if cal is not None:
            config, _, result = sensitivity.run(model, cal, self.config, tokenizer, tied, on_tpu)
        report = decide(config, model, tied, on_tpu)
        if result is not None:     # before the swap: a searching format weighs by its importance
            report.attach_calibration(result)
        return self.apply(model, report)

    def apply(self, model: nn.Module, report: QuantizationReport) -> nn.Module:
        """Swap in the modules ``report`` decided (``plan``), quantizing the weights already
        known; returns ``model``, whose ``autoxla_quantization`` is ``report``."""
        _refuse_stacked(model)
        report.bytes_before = _weight_bytes(model)
        with repointing_references(model):
            self._swap(model, report)
        report.bytes_after = _weight_bytes(model)
        record_state(model, quantization=report)
        saving.attach(model)   # transformers' own save would drop the quantization config
        logger.info("%s", report)
        return model

    @staticmethod
    def _swap(model: nn.Module, report) -> None:
        for name, d in report.layers.items():
            path, _, leaf = name.rpartition(".")
            parent = model.get_submodule(path)      # "" is the model itself
            if d.experts:
                _swap_experts(parent, leaf, d, report)
                continue
            old = getattr(parent, leaf)
            table = d.backend == GATHER
            new = _quantized_table_like(old, d) if table else _quantized_like(old, d)
            if old.weight.device.type != "meta":
                rows = linear_rows(new, old.weight.detach().cpu())   # a Conv1D's transposed
                q = quantize_tensor(rows, d.fmt, name,
                                    importance=report.importance(name))
                report.record_stats(name, q)
                dev = old.weight.device
                t = {k: v.to(dev) for k, v in stored_tensors(q).items()}
                tensors = (t["weight"], t["weight_scale"], t.get("weight_zero_point"))
                if table:
                    new.load_quantized(*tensors)
                else:
                    new.load_quantized(*tensors, None if old.bias is None else old.bias.detach(),
                                       offset=t.get("weight_offset"))
            setattr(parent, leaf, new)


LanguageModelQuantizer = ModelQuantizer


def _refuse_stacked(model: nn.Module) -> None:
    stacked = [n for n, m in model.named_modules() if hasattr(m, "per_layer_items")]
    if stacked:
        raise ValueError(
            f"{type(model).__name__}'s decoder stack ({stacked[0]}) is scanned: its layers' "
            "weights are stacked tensors that quantizing one layer at a time cannot replace. "
            "Quantize while loading (from_pretrained(..., do_quant=True, quantization_config="
            "...)), or load with scan_layers=False and quantize afterwards")


def _swap_experts(parent: nn.Module, leaf: str, d: LayerDecision, report) -> None:
    """The experts parameter ``leaf`` of ``parent`` replaced by a QuantizedExperts module under
    the same name (quantized by the C engine unless it is still on meta)."""
    old = parent._parameters[leaf]
    new = QuantizedExperts(d.fmt, d.experts, bool(parent.is_transposed), device=old.device)
    moe.use_on(parent)    # transformers' own experts forwards read the float parameter
    if old.device.type != "meta":
        q = quantize_experts(old.detach().cpu(), new, d.name)
        report.record_stats(d.name, q)
        t = {k: v.to(old.device) for k, v in stored_tensors(q).items()}
        new.load_quantized(t["weight"], t["weight_scale"], t.get("weight_zero_point"),
                           t.get("weight_offset"))
    del parent._parameters[leaf]
    parent.add_module(leaf, new)


def _quantized_like(old: nn.Linear, d: LayerDecision) -> QuantizedLinear:
    dev = old.weight.device
    dtype = old.bias.dtype if old.bias is not None else old.weight.dtype
    new = QuantizedLinear(d.fmt, bias=old.bias is not None, backend=d.backend,
                          quantize_activation=d.activation_quant, dtype=dtype, device=dev)
    new.source_transposed = d.transposed      # a Conv1D's float weight is (in, out)
    if old.bias is not None:
        new.bias.requires_grad_(old.bias.requires_grad)
    return new


def _quantized_table_like(old: nn.Embedding, d: LayerDecision) -> QuantizedEmbedding:
    return QuantizedEmbedding(d.fmt, padding_idx=old.padding_idx, dtype=old.weight.dtype,
                              device=old.weight.device)
