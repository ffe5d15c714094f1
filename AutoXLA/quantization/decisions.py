"""What quantization decides, before any module changes: per layer its format, its backend (and
why the preferred ones could not run it) and whether its activations are quantized; the layers
kept in full precision and why (``decide``). ``ModelQuantizer`` (quantizer.py) applies a
report by swapping modules; calibration (sensitivity.py) measures the layers it lists."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from torch import nn

from .. import _native
from ..backend import pallas_target
from ..sharding.rules import is_experts
from . import pallas_tiles
from .backends import ACTIVATION_QUANT, choose
from .config import LayerFormat, QuantizationConfig
from .embedding import GATHER, QuantizedEmbedding
from .experts import EXPERTS_BACKEND, WHY_NO_KERNEL, experts_format


@dataclass
class LayerDecision:
    name: str
    fmt: LayerFormat
    backend: str
    passed_over: list[str]          # why each preferred backend could not run this layer
    activation_quant: bool          # dynamic int8 activations actually used
    max_err: float | None = None    # error statistics of the C engine, once the weight is known
    min_sqnr_db: float | None = None
    median_sqnr_db: float | None = None
    experts: int = 0                # a mixture-of-experts projection of this many experts
    source_shape: tuple[int, ...] = ()   # its float parameter's shape, as a checkpoint holds it
    transposed: bool = False        # a Conv1D (GPT-2): the float weight is stored (in, out)
    # TPU generations where torch_xla tuned Pallas tiles for this layer (pallas_tiles.py); on
    # the others its Pallas backend gives way to the next one
    pallas_tuned: tuple[int, ...] = ()


@dataclass
class QuantizationReport:
    """What was quantized, what was skipped and why, and the model's weight bytes before/after."""

    config: QuantizationConfig
    layers: dict[str, LayerDecision] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)   # module name -> reason
    bytes_before: int = 0
    bytes_after: int = 0
    warnings: list[str] = field(default_factory=list)
    # sensitivity.CalibrationReport, set when quantized after calibration (sensitivity.py plans
    # with this module, so the type is named, not imported)
    calibration: object = None

    def attach_calibration(self, calibration) -> None:
        """Record what calibration measured and chose; the layers its target kept in full
        precision say so instead of naming the exclude_layers pattern it added."""
        self.calibration = calibration
        for name in self.skipped:
            why = calibration.reason(name)
            if why is not None:
                self.skipped[name] = why

    def importance(self, name: str):
        """Calibration's per-input weights of layer ``name`` for a searching format, or None."""
        return self.calibration.importance(name) if self.calibration is not None else None

    def notes(self) -> list[str]:
        """The lines the plan prints under its table: warnings, then calibration's summary."""
        return list(self.warnings) + (self.calibration.lines() if self.calibration else [])

    def record_stats(self, name: str, q: "_native.Quantized") -> None:
        d = self.layers[name]
        if q.max_err is not None:
            d.max_err = float(q.max_err.max()) if q.max_err.numel() else 0.0
            sq = q.sqnr_db.double()
            d.min_sqnr_db = float(sq.min()) if sq.numel() else math.inf
            d.median_sqnr_db = float(sq.median()) if sq.numel() else math.inf

    def __str__(self) -> str:
        tables = sum(1 for d in self.layers.values() if d.backend == GATHER)
        experts = sum(1 for d in self.layers.values() if d.experts)
        linears = len(self.layers) - tables - experts
        lines = [f"AutoXLA quantization: {linears} linear(s) "
                 + (f"and {experts} expert projection(s) " if experts else "")
                 + (f"and {tables} embedding table(s) " if tables else "")
                 + f"quantized, {len(self.skipped)} kept in full precision; model weights "
                 f"{self.bytes_before / 2**20:.2f} MiB -> {self.bytes_after / 2**20:.2f} MiB "
                 f"({self.bytes_after / max(self.bytes_before, 1):.1%})"]
        by_kind: dict[tuple, int] = {}
        for d in self.layers.values():
            key = (d.fmt.label, d.backend, d.activation_quant, bool(d.experts))
            by_kind[key] = by_kind.get(key, 0) + 1
        for (label, backend, act, experts), n in sorted(by_kind.items()):
            what = " expert projection(s)" if experts else ""
            lines.append(f"  {n}{what} x {label} via {backend}"
                         f"{' with int8 activations' if act else ''}")
        pallas = [d for d in self.layers.values() if d.backend == "pallas"]
        if pallas:
            lines.append("  Pallas tiles tuned by torch_xla: " + ", ".join(
                f"v{g} {sum(g in d.pallas_tuned for d in pallas)}/{len(pallas)}"
                for g in pallas_tiles.GENERATIONS)
                + " layer(s); elsewhere those layers take the next backend")
        worst = [d for d in self.layers.values() if d.min_sqnr_db is not None]
        if worst:
            w = min(worst, key=lambda d: d.min_sqnr_db)
            lines.append(f"  weight SQNR: worst row {w.min_sqnr_db:.1f} dB in {w.name}")
        for name, why in self.skipped.items():
            lines.append(f"  kept {name}: {why}")
        if self.calibration is not None:
            lines.extend(f"  {m}" for m in self.calibration.lines())
        lines.extend(f"  note: {m}" for m in self.warnings)
        return "\n".join(lines)


def decide(cfg: QuantizationConfig, model: nn.Module, tied: dict[str, str] | None = None,
           on_tpu: bool | None = None) -> QuantizationReport:
    """Decide, without changing the model, which linears (expert projections, embedding
    tables) are quantized, in which format, by which backend, and why the others are not."""
    if on_tpu is None:
        on_tpu = on_tpu_of(model)
    tied_names = set(tied or {}) | set((tied or {}).values()) | shared_parameter_names(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    report = QuantizationReport(cfg)
    matched = set()
    pallas_refused = []
    # nn.MultiheadAttention passes out_proj.weight straight to F.multi_head_attention_forward
    # instead of calling out_proj: a quantized layer there would be read as raw integers.
    read_directly = {id(m.out_proj) for m in model.modules()
                     if isinstance(m, nn.MultiheadAttention)}
    for name, m in model.named_modules():
        if is_experts(m):
            _plan_experts(cfg, name, m, report, matched)
        conv1d = is_conv1d(m)
        if not (isinstance(m, nn.Linear) or conv1d):
            continue
        if id(m) in read_directly:
            report.skipped[name] = ("nn.MultiheadAttention reads its out_proj weight directly, "
                                    "so it stays in full precision")
            continue
        pattern = cfg.excludes(name)
        if pattern is not None:
            matched.add(pattern)
            report.skipped[name] = f"excluded by exclude_layers pattern {pattern!r}"
            continue
        if m is head and not cfg.quantize_lm_head:
            report.skipped[name] = "the lm head stays in full precision (quantize_lm_head=False)"
            continue
        if f"{name}.weight" in tied_names:
            report.skipped[name] = "its weight is tied to another tensor (quantizing would untie it)"
            continue
        in_features, out_features = (m.weight.shape if conv1d
                                     else (m.in_features, m.out_features))
        fmt = cfg.layer_format(name, in_features, out_features)
        act_wanted = cfg.quantize_activation and not cfg.float_activations(name)
        backend, passed_over = choose(fmt, cfg, on_tpu, name, m.weight.dtype, act_wanted)
        if cfg.use_pallas and backend != "pallas":
            pallas_refused.append(passed_over[0] if passed_over else backend)
        act = (cfg.quantize_activation and backend in ACTIVATION_QUANT
               and not cfg.float_activations(name))
        report.layers[name] = LayerDecision(name, fmt, backend, passed_over, act,
                                            source_shape=tuple(m.weight.shape) if conv1d else (),
                                            transposed=conv1d)
        if fmt.symmetric and fmt.per_channel:   # what the Pallas kernel would do on each TPU
            report.layers[name].pallas_tuned = pallas_tiles.tuned_generations(
                fmt.out_features, fmt.in_features, m.weight.dtype, act_wanted)
    if cfg.quantize_embeddings:
        _plan_embeddings(cfg, model, tied_names, report, matched)
    for p in cfg.exclude_layers:
        if p not in matched:
            msg = (f"exclude_layers pattern {p!r} matches no linear layer of "
                   f"{type(model).__name__}; check the module names (model.named_modules())")
            report.warnings.append(msg)
            warnings.warn(msg, stacklevel=3)
    if pallas_refused:
        msg = (f"use_pallas=True, but {len(pallas_refused)} layer(s) cannot use the Pallas kernel "
               f"({pallas_refused[0]}); they use the next backend instead")
        report.warnings.append(msg)
        warnings.warn(msg, stacklevel=3)
    no_act = [d.name for d in report.layers.values()      # a table's lookup has no input
              if cfg.quantize_activation and not d.activation_quant and d.backend != GATHER
              and not d.experts and not cfg.float_activations(d.name)]
    if no_act:
        msg = (f"quantize_activation=True, but the {report.layers[no_act[0]].backend} backend "
               f"does not quantize activations: {len(no_act)} layer(s) keep float activations")
        report.warnings.append(msg)
        warnings.warn(msg, stacklevel=3)
    if not report.layers:
        msg = (f"quantization was asked for, but no layer of {type(model).__name__} is quantized: "
               "the model stays in full precision (the report, model.autoxla_quantization, says "
               f"why each of its {len(report.skipped)} candidate(s) was kept)")
        report.warnings.append(msg)
        warnings.warn(msg, stacklevel=3)
    return report


def _plan_experts(config: QuantizationConfig, name: str, module: nn.Module, report,
                  matched: set) -> None:
    """A mixture-of-experts module's fused projections (``gate_up_proj`` or ``up_proj``, and
    ``down_proj``: [experts, out, in] parameters) become QuantizedExperts of the format a
    linear of one expert's shape gets (quantization/experts.py); their biases stay float."""
    for leaf in ("gate_up_proj", "up_proj", "down_proj"):
        weight = module._parameters.get(leaf)
        if weight is None or weight.dim() != 3:
            continue
        full = f"{name}.{leaf}"
        pattern = config.excludes(full)
        if pattern is not None:
            matched.add(pattern)
            report.skipped[full] = f"excluded by exclude_layers pattern {pattern!r}"
            continue
        fmt = experts_format(config, full, weight, bool(module.is_transposed))
        report.layers[full] = LayerDecision(full, fmt, EXPERTS_BACKEND, [WHY_NO_KERNEL], False,
                                            experts=weight.shape[0],
                                            source_shape=tuple(weight.shape))

def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2 and its family): a linear whose weight is stored (in, out),
    computing x @ weight + bias. Quantized, it becomes a QuantizedLinear like any other, its
    weight transposed to (out, in) rows before the C engine sees it."""
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf")
            and getattr(module, "weight", None) is not None and module.weight.dim() == 2)


def _plan_embeddings(config: QuantizationConfig, model: nn.Module, tied_names: set[str], report,
                     matched: set) -> None:
    """quantize_embeddings: the token table (every nn.Embedding of a model that has no
    get_input_embeddings) becomes int8, one scale per row."""
    tied_tables = []
    token_table = _input_embeddings(model)
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding) or isinstance(m, QuantizedEmbedding):
            continue
        pattern = config.excludes(name)
        if pattern is not None:
            matched.add(pattern)
            report.skipped[name] = f"excluded by exclude_layers pattern {pattern!r}"
        elif token_table is not _NO_METHOD and m is not token_table:
            # Models read other tables' weights directly (SAM's point and mask tokens, DETR's
            # queries: `.weight` as a tensor), which an int8 table would silently corrupt.
            report.skipped[name] = ("not the token embedding table (get_input_embeddings): "
                                    "models read such weights directly, so it stays in full "
                                    "precision")
        elif f"{name}.weight" in tied_names:
            # One tensor cannot be an int8 table and the head's float weight at once; an int8
            # head sharing the table would change the logits' format without being asked.
            tied_tables.append(name)
            report.skipped[name] = ("its table is tied to the output projection "
                                    "(tie_word_embeddings): quantizing it would untie them")
        elif type(m).forward is not nn.Embedding.forward:
            # e.g. Gemma's scaled embeddings multiply by a factor cast to self.weight.dtype,
            # which an int8 table would truncate.
            report.skipped[name] = (f"{type(m).__name__} has its own forward, which may read "
                                    "the float table; it stays in full precision")
        elif m.max_norm is not None:
            report.skipped[name] = "max_norm renormalises the float table at lookup"
        else:
            fmt = config.embedding_format(m.num_embeddings, m.embedding_dim)
            report.layers[name] = LayerDecision(name, fmt, GATHER, [], False)
    if tied_tables:
        msg = (f"quantize_embeddings=True, but {', '.join(tied_tables)} is tied to the output "
               "projection (tie_word_embeddings), so it stays in full precision with the head")
        report.warnings.append(msg)
        warnings.warn(msg, stacklevel=4)


_NO_METHOD = object()


def _input_embeddings(model: nn.Module):
    """The model's token table, None if it has none, or _NO_METHOD when it cannot say (a model
    built in code without get_input_embeddings)."""
    get = getattr(model, "get_input_embeddings", None)
    if get is None:
        return _NO_METHOD
    try:
        return get()
    except (NotImplementedError, AttributeError):
        return None


def shared_parameter_names(model: nn.Module) -> set[str]:
    """Names of parameters that share one tensor with another name (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return {n for names in by_id.values() if len(names) > 1 for n in names}


def on_tpu_of(model: nn.Module):
    """backends.choose's ``tpu`` for a model on its device (see quantization/backends.py)."""
    devices = {p.device.type for p in model.parameters()}
    if "xla" not in devices and "meta" not in devices:
        return False
    try:
        return pallas_target()
    except ImportError:
        return False
