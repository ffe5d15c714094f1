"""SmoothQuant: move each input channel's activation range into the weights before W8A8.

Per-row int8 activations lose the small channels of a row that one outlier channel stretches.
With s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) the layer computes (X / s) (W * s)^T, the same
product, with a flatter X and a slightly rougher W (Xiao et al., SmoothQuant, 2022).

The division of X is applied only where it folds exactly into the op that produced X:
  norm       a norm whose output the linears read as is (q/k/v after input_layernorm, gate/up
             after post_attention_layernorm): its weight (and bias) divided by s, one s shared by
             all linears reading that output, each of their weights' columns multiplied by s;
  up         a gated MLP, down(act(gate(x)) * up(x)): up's output rows (and bias) divided by s,
             down's columns multiplied by s.
Other linears (o_proj, ...) are not smoothed. A norm folds only if dividing its weight (and bias)
divides its output: checked by running it on the CPU (Gemma's (1 + weight) norm does not).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .. import backend
from .calibration import Calibration

# s is clamped to [1e-5, 1e5]: a channel that is zero in X or W gets s = 1 (nothing to migrate).
_S_MIN, _S_MAX = 1e-5, 1e5


@dataclass
class SmoothGroup:
    producer: str                 # the norm, or the up projection, whose output is divided by s
    consumers: tuple[str, ...]    # the linears reading that output: weight columns times s
    scale: torch.Tensor           # s, (channels,) float32 on the CPU
    kind: str = "norm"            # "norm" | "up"


@dataclass
class Smoothing:
    """The smoothing factors of a model; ``transform`` applies them to one named tensor (from a
    checkpoint, or the model's own), ``apply_smoothing`` to a model in place."""

    alpha: float
    groups: list[SmoothGroup] = field(default_factory=list)
    check_nll: float | None = None   # max |NLL change| per token, smoothed vs original float

    def __post_init__(self):
        self._col = {f"{c}.weight": g.scale for g in self.groups for c in g.consumers}
        self._div = {f"{g.producer}.{leaf}": g.scale for g in self.groups for leaf in ("weight", "bias")}

    def tensor_names(self) -> set[str]:
        """Every tensor name ``transform`` changes (biases listed whether or not they exist)."""
        return set(self._col) | set(self._div)

    def transform(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the tensor called ``name``) with the smoothing applied, in float32 (float64 for
        float64), returned in t's dtype: a consumer's weight times s by column; a producer's weight or bias divided by
        s (by row for the up projection's (out, in) weight)."""
        if name not in self._col and name not in self._div:
            return t
        out = t.to(torch.promote_types(t.dtype, torch.float32))
        if name in self._col:
            out = out * self._col[name].to(out.device)[None, :]
        if name in self._div:
            s = self._div[name].to(out.device)
            out = out / (s[:, None] if out.dim() == 2 else s)
        return out.to(t.dtype)

    def summary(self) -> str:
        norms = sum(1 for g in self.groups if g.kind == "norm")
        layers = sum(len(g.consumers) for g in self.groups)
        check = "" if self.check_nll is None else (
            f"; float output unchanged on the calibration tokens (max |NLL change| per token "
            f"{self.check_nll:.1e})")
        return (f"SmoothQuant alpha {self.alpha:g} on {layers} linear(s): {norms} folded into a "
                f"norm, {len(self.groups) - norms} into an up projection{check}")


def factors(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), 1 where either is zero."""
    x, w = x_absmax.double(), w_absmax.double()
    s = x.clamp(min=1e-30).pow(alpha) / w.clamp(min=1e-30).pow(1 - alpha)
    s = torch.where((x > 0) & (w > 0), s.clamp(_S_MIN, _S_MAX), torch.ones_like(s))
    return s.float()


def norm_folds(norm: nn.Module) -> bool:
    """Whether dividing ``norm``'s weight (and bias) by s divides its output by s, run on random
    CPU inputs with the module's own forward (its parameters swapped for CPU tensors)."""
    params = dict(norm.named_parameters(recurse=False))
    if set(params) - {"weight", "bias"} or "weight" not in params or list(norm.buffers()):
        return False
    n = params["weight"].numel()
    g = torch.Generator().manual_seed(0)
    w, s = torch.rand(n, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5
    x = torch.randn(3, n, generator=g)
    b = torch.randn(n, generator=g) if "bias" in params else None

    def run(weight, bias):
        values = {"weight": weight} | ({"bias": bias} if bias is not None else {})
        return torch.func.functional_call(norm, values, (x,))

    try:
        ref = run(w, b) / s
        got = run(w / s, None if b is None else b / s)
    except Exception:   # a norm whose forward needs more than one tensor input: not folded
        return False
    # float32: both sides are one rounding of the same products (|x| <= ~5, s in [0.5, 1.5]).
    return isinstance(got, torch.Tensor) and torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


def plan_smoothing(model: nn.Module, calibration: Calibration, activation_layers: set[str],
                   alpha: float, tied_names: set[str]) -> Smoothing:
    """Smoothing groups for the producers whose every consumer is a plain, untied nn.Linear and
    at least one of them quantizes its activations (``activation_layers``)."""
    modules = dict(model.named_modules())
    readers: dict[str, list[str]] = {}
    for linear, producer in calibration.producers.items():
        readers.setdefault(producer, []).append(linear)
    groups = []
    for producer, consumers in sorted(readers.items()):
        consumers = sorted(consumers)
        if not activation_layers & set(consumers):
            continue
        if any(f"{c}.weight" in tied_names or not isinstance(modules.get(c), nn.Linear)
               or c not in calibration.layers for c in consumers):
            continue
        owner = modules.get(producer)
        if isinstance(owner, nn.Linear):
            if f"{producer}.weight" in tied_names or len(consumers) != 1:
                continue
            kind = "up"
        elif owner is not None and norm_folds(owner):
            kind = "norm"
        else:
            continue
        x = torch.stack([calibration.layers[c].absmax for c in consumers]).amax(0)
        w = torch.stack([calibration.layers[c].weight_absmax for c in consumers]).amax(0)
        groups.append(SmoothGroup(producer, tuple(consumers), factors(x, w, alpha), kind))
    return Smoothing(alpha, groups)


def apply_smoothing(model: nn.Module, smoothing: Smoothing) -> None:
    """Applies ``smoothing`` to ``model``'s own tensors in place (on their device)."""
    names = smoothing.tensor_names()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name in names:
                t.copy_(smoothing.transform(name, t.detach()))
    if any(p.device.type == "xla" for p in model.parameters()):
        backend.sync()   # on its own: the next forward's graph is then the same every time
