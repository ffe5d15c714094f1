"""Per-layer sensitivity to quantization, and auto-exclusion, measured on the calibration tokens.

Each planned linear is emulated on its device by a forward hook: its weight as the C engine
quantizes it (quantized once on the host, kept on the device in its stored form, dequantized in
the graph), and for W8A8 int8 activations per row with scale absmax / 127, as
torch.ops.xla.quantized_matmul computes them. On the float model's own inputs this gives each
layer's output SQNR as planned and with float activations. The model-level error is the relative
perplexity increase on the calibration tokens with every layer emulated as chosen; each layer's
choice (float, weights only, weights and activations) is a device tensor, so one compiled graph
serves every choice the search tries (one per decoder layer on XLA: calibration.layer_by_layer).

Auto-exclusion (CalibrationConfig.target): layers are changed in order, W8A8 layers to float
activations (W8A16), worst output SQNR first, then any layer to full precision, worst W8A16 SQNR
first; a bisection finds the fewest changes whose measured error is within the target (the
all-float end has error 0 by construction, so the search always ends at a measured point or there).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .calibration import (Calibration, CalibrationConfig, check_ids, collect, layer_by_layer,
                          model_device, read_back, refuse_scanned, token_batch, token_nll)
from .config import QuantizationConfig
from .decisions import decide, shared_parameter_names
from .embedding import GATHER
from .linear import stored_tensors
from .packing import dequantize
from .weights import quantize_tensor
from .smoothing import Smoothing, apply_smoothing, plan_smoothing

FLOAT, WEIGHTS, ACTIVATIONS = 0, 1, 2     # full precision; quantized weight; W8A8
# The smoothed float model must score every calibration token as the original did: in float32 the
# two differ by rounding (~1e-6 nats per token); a 16-bit model's weights are rounded again after
# the division (2^-9 relative), which moves the mean by ~1e-3. A fold that is not exact (a norm
# output read by something other than the linears it feeds) moves it by O(0.1-1).
_CHECK_MEAN_NLL = {torch.float32: 1e-3, torch.float64: 1e-3}
_CHECK_MEAN_NLL_16BIT = 2e-2


def fake_rows(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-row int8 activations: scale = max|row| / 127 in x's dtype, round, rescale."""
    scale = x.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / safe).clamp(-127, 127) * scale


class _EngineWeights:
    """Each planned linear's weight as the C engine quantizes it (the same call and importance the
    real load makes, so the emulation is the real model bit for bit, whatever the format): its
    stored tensors, quantized on the host once and kept on the device (0.5-1 byte per weight),
    dequantized inside each step's graph by the same function the fallback backend runs."""

    def __init__(self, modules: dict, decisions: dict, importances: dict):
        self.formats = {n: d.fmt for n, d in decisions.items()}
        self.stored = {}
        for n, fmt in self.formats.items():
            w = modules[n].weight
            q = quantize_tensor(w.detach().cpu(), fmt, n, stats=False, importance=importances.get(n))
            self.stored[n] = {k: v.to(w.device) for k, v in stored_tensors(q).items()}

    def weight(self, name: str) -> torch.Tensor:
        t = self.stored[name]
        return dequantize(t["weight"], t["weight_scale"], t.get("weight_zero_point"),
                          self.formats[name], torch.float32, t.get("weight_offset"))


class _Emulation:
    """Forward hooks that replace each planned linear's output by its emulated quantized output
    where its mode says so, and accumulate each layer's errors against the float output."""

    def __init__(self, model: nn.Module, decisions: dict, importances: dict | None = None):
        refuse_scanned(model)
        self.model, self.decisions = model, decisions
        self.weights = _EngineWeights(dict(model.named_modules()), decisions, importances or {})
        self.device = model_device(model)
        self.names = list(decisions)
        self.modes = None
        self._reset_errors()
        self.handles = []

    def _reset_errors(self) -> None:
        # Made on the host and sent: device data, as after a step, so every step is one graph
        # (zeros made on the device would be constants in the first graph only).
        self.errors = {n: torch.zeros(3).to(self.device) for n in self.names}

    def _hook(self, index: int, name: str):
        d = self.decisions[name]

        def hook(module, args, out):
            x = args[0]
            w = self.weights.weight(name).to(x.dtype)
            y_w = F.linear(x, w, module.bias)
            y_a = F.linear(fake_rows(x), w, module.bias) if d.activation_quant else y_w
            ref = out.float()
            self.errors[name] = self.errors[name] + torch.stack(
                [(y_a.float() - ref).pow(2).sum(), (y_w.float() - ref).pow(2).sum(), ref.pow(2).sum()])
            mode = self.modes[name]
            return torch.where(mode == ACTIVATIONS, y_a, torch.where(mode == WEIGHTS, y_w, out))
        return hook

    def __enter__(self):
        modules = dict(self.model.named_modules())
        self.handles = [modules[n].register_forward_hook(self._hook(i, n))
                        for i, n in enumerate(self.names)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def token_nll(self, ids: torch.Tensor, modes: dict[str, int]) -> torch.Tensor:
        """Each token's NLL (on the CPU) with the layers in ``modes`` emulated (others float)."""
        # One device tensor per layer (not one vector indexed by layer), so that every decoder
        # layer's graph is the same and compiles once; of shape (1,), since torch_xla bakes 0-d
        # tensors holding 0 or 1 into the graph as constants.
        self.modes = {n: torch.tensor([modes.get(n, FLOAT)], dtype=torch.int32).to(self.device)
                      for n in self.names}
        with torch.no_grad(), layer_by_layer(self.model):
            nll = token_nll(self.model, ids.to(self.device))
        return read_back(nll)[0]

    def take_errors(self) -> dict[str, tuple[float, float]]:
        """Output SQNR (dB) per layer as (planned, weights only), read once; resets the sums."""
        sums = read_back(torch.stack([self.errors[n] for n in self.names]))[0].double()
        self._reset_errors()
        return {n: (_sqnr(s[2], s[0]), _sqnr(s[2], s[1])) for n, s in zip(self.names, sums)}


def _sqnr(signal: torch.Tensor, noise: torch.Tensor) -> float:
    return math.inf if noise <= 0 else float(10 * torch.log10(signal / noise))


@dataclass
class LayerSensitivity:
    sqnr_db: float              # output SQNR as planned (W8A8 where it quantizes activations)
    weights_only_sqnr_db: float  # output SQNR with float activations


@dataclass
class CalibrationReport:
    """What calibration measured and chose: per-layer output SQNR, perplexities on the
    calibration tokens (emulated), the smoothing, and the layers auto-exclusion changed."""

    tokens: int
    layers: dict[str, LayerSensitivity]
    float_perplexity: float
    quantized_perplexity: float           # every layer as planned
    perplexity: float                     # as chosen (== quantized_perplexity without a target)
    target: float | None = None
    smoothing: Smoothing | None = None
    float_activations: list[str] = field(default_factory=list)   # W8A8 -> W8A16 by the target
    kept_float: list[str] = field(default_factory=list)          # full precision by the target
    evaluations: int = 0
    # E[x_j^2] of each planned layer's input as the quantized model sees it (after smoothing):
    # the weighting of the C engine's scale search (QuantizationConfig(scale_search=True)).
    importances: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    unmeasured_experts: int = 0   # expert projections quantized but float in the emulation

    def importance(self, name: str) -> torch.Tensor | None:
        return self.importances.get(name)

    @property
    def error(self) -> float:
        """The chosen model's relative perplexity increase on the calibration tokens."""
        return self.perplexity / self.float_perplexity - 1

    def reason(self, name: str) -> str | None:
        s = self.layers.get(name)
        if name in self.kept_float:
            return (f"kept in full precision by calibration's target (+{self.target:.1%} "
                    f"perplexity): output SQNR {s.weights_only_sqnr_db:.1f} dB quantized")
        if name in self.float_activations:
            return (f"float activations (W8A16) by calibration's target: output SQNR "
                    f"{s.sqnr_db:.1f} dB with int8 activations, {s.weights_only_sqnr_db:.1f} dB without")
        return None

    def lines(self) -> list[str]:
        """The summary the quantization report and the plan print."""
        out = [f"calibration: {self.tokens} tokens; perplexity on them (emulated) float "
               f"{self.float_perplexity:.3f}, quantized as planned {self.quantized_perplexity:.3f} "
               f"({self.quantized_perplexity / self.float_perplexity - 1:+.2%})"
               + (f", with the {self.unmeasured_experts} expert projection(s) left float (not "
                  "emulated)" if self.unmeasured_experts else "")]
        if self.smoothing is not None:
            out.append(self.smoothing.summary())
        if self.target is not None:
            out.append(f"auto-exclusion to +{self.target:.2%}: {len(self.float_activations)} "
                       f"layer(s) with float activations (W8A16), {len(self.kept_float)} kept in "
                       f"full precision; perplexity {self.perplexity:.3f} ({self.error:+.2%}), "
                       f"{self.evaluations} evaluation(s)")
            if self.float_activations:
                out.append(f"  W8A16: {', '.join(self.float_activations)}")
            if self.kept_float:
                out.append(f"  full precision: {', '.join(self.kept_float)}")
        worst = sorted(self.layers.items(), key=lambda kv: kv[1].sqnr_db)[:3]
        if worst:
            out.append("worst output SQNR: " + ", ".join(f"{n} {s.sqnr_db:.1f} dB" for n, s in worst))
        return out

    def table(self) -> str:
        """Every layer, worst first: output SQNR as planned and with float activations."""
        rows = sorted(self.layers.items(), key=lambda kv: kv[1].sqnr_db)
        width = max([len(n) for n in self.layers] + [5])
        lines = [f"{'layer'.ljust(width)}  planned dB  weights-only dB  choice"]
        for n, s in rows:
            choice = ("full precision" if n in self.kept_float else
                      "W8A16" if n in self.float_activations else "as planned")
            lines.append(f"{n.ljust(width)}  {s.sqnr_db:10.1f}  {s.weights_only_sqnr_db:15.1f}  {choice}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return "\n".join(self.lines() + [self.table()])

    def apply(self, config: QuantizationConfig) -> QuantizationConfig:
        """``config`` with the layers auto-exclusion changed (the config the model is quantized
        with, and saved with)."""
        return dataclasses.replace(
            config, exclude_layers=list(config.exclude_layers) + self.kept_float,
            float_activation_layers=list(config.float_activation_layers) + self.float_activations)


def run(model: nn.Module, cal: CalibrationConfig, config: QuantizationConfig, tokenizer=None,
        tied: dict[str, str] | None = None, on_tpu: bool | None = None
        ) -> tuple[QuantizationConfig, Smoothing | None, CalibrationReport]:
    """Calibrate the float ``model``, smooth it in place (W8A8), measure every planned layer and
    choose. Returns the config to quantize with, the smoothing (for the checkpoint's tensors) and
    the report."""
    ids = token_batch(cal.data, tokenizer, cal.max_tokens, cal.seq_len)
    check_ids(model, ids)
    with warnings.catch_warnings():       # the quantizer warns again when it quantizes
        warnings.simplefilter("ignore")
        planned = decide(config, model, tied, on_tpu)
    # Linears only: tables have no input to measure, and expert projections (quantized
    # weight-only, quantization/experts.py) are not modules calibration can hook one by one.
    decisions = {n: d for n, d in planned.layers.items() if d.backend != GATHER and not d.experts}
    if isinstance(cal.data, Calibration):
        calibration = cal.data
        missing = [n for n in decisions if n not in calibration.layers]
        if missing:
            raise ValueError(f"the Calibration given has no statistics for {missing[:3]}: it was "
                             f"measured on another model; run calibrate() on this one")
        with torch.no_grad(), layer_by_layer(model):
            before = read_back(token_nll(model, ids.to(model_device(model))))[0]
    else:
        calibration, before = collect(model, ids)
    smoothing = None
    if cal.smooth and config.quantize_activation:
        tied = tied or {}
        tied_names = set(tied) | set(tied.values()) | shared_parameter_names(model)
        smoothing = plan_smoothing(model, calibration, {n for n, d in decisions.items()
                                                        if d.activation_quant}, cal.alpha, tied_names)
        apply_smoothing(model, smoothing)
    importances = _importances(calibration, smoothing, decisions)
    with _Emulation(model, decisions, importances) as emu:
        float_nll = emu.token_nll(ids, {})
        errors = emu.take_errors()
        if smoothing is not None:
            _check_smoothing(smoothing, before, float_nll, model)
        plan_modes = {n: ACTIVATIONS if d.activation_quant else WEIGHTS for n, d in decisions.items()}
        q_ppl = _ppl(emu.token_nll(ids, plan_modes))
        f_ppl = _ppl(float_nll)
        report = CalibrationReport(ids.numel(), {n: LayerSensitivity(*e) for n, e in errors.items()},
                                   f_ppl, q_ppl, q_ppl, cal.target, smoothing, evaluations=2,
                                   importances=importances,
                                   unmeasured_experts=sum(1 for d in planned.layers.values()
                                                          if d.experts))
        if cal.target is not None and q_ppl / f_ppl - 1 > cal.target:
            _search(emu, ids, plan_modes, report)
    return report.apply(config), smoothing, report


def _importances(calibration: Calibration, smoothing: Smoothing | None, decisions: dict
                 ) -> dict[str, torch.Tensor]:
    """Each planned layer's E[x_j^2]; a smoothed layer reads x / s, so E[x_j^2] / s_j^2."""
    scales = {c: g.scale for g in (smoothing.groups if smoothing else []) for c in g.consumers}
    out = {}
    for name in decisions:
        if name in calibration.layers:
            ms = calibration.importance(name)
            out[name] = ms / scales[name].pow(2) if name in scales else ms
    return out


def _ppl(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean()))


def _check_smoothing(smoothing: Smoothing, before: torch.Tensor, after: torch.Tensor, model) -> None:
    diff = (after.double() - before.double()).abs()
    smoothing.check_nll = float(diff.max())
    dtype = next(model.parameters()).dtype
    limit = _CHECK_MEAN_NLL.get(dtype, _CHECK_MEAN_NLL_16BIT)
    if float(diff.mean()) > limit:
        raise RuntimeError(
            f"SmoothQuant changed {type(model).__name__}'s float output: the mean NLL per "
            f"calibration token moved by {float(diff.mean()):.2e} (limit {limit:g} for {dtype}), "
            "so some smoothed norm or up projection feeds more than the linears it was folded "
            "into. Calibrate without smoothing (CalibrationConfig(smooth=False)) and please report "
            "the model")


def _search(emu: _Emulation, ids: torch.Tensor, plan_modes: dict[str, int],
            report: CalibrationReport) -> None:
    """Bisection over the ordered changes for the fewest within report.target."""
    layers = report.layers
    steps = [(n, WEIGHTS) for n in sorted((n for n, m in plan_modes.items() if m == ACTIVATIONS),
                                          key=lambda n: layers[n].sqnr_db)]
    steps += [(n, FLOAT) for n in sorted(plan_modes, key=lambda n: layers[n].weights_only_sqnr_db)]

    def modes_after(k: int) -> dict[str, int]:
        modes = dict(plan_modes)
        modes.update(steps[:k])
        return modes

    lo, hi, best = 0, len(steps), report.float_perplexity   # all float: the float model itself
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ppl = _ppl(emu.token_nll(ids, modes_after(mid)))
        report.evaluations += 1
        if ppl / report.float_perplexity - 1 <= report.target:
            hi, best = mid, ppl
        else:
            lo = mid
    chosen = modes_after(hi)
    report.perplexity = best
    report.float_activations = [n for n, m in chosen.items() if m == WEIGHTS and plan_modes[n] == ACTIVATIONS]
    report.kept_float = [n for n, m in chosen.items() if m == FLOAT]
