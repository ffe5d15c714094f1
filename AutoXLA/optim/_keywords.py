"""The original AutoXLA's optimizer keywords that have no counterpart here."""
from __future__ import annotations

import warnings


def warn_without_effect(optimizer: str, keyword: str, why: str) -> None:
    """One warning, at the caller's construction line, that ``keyword`` changes nothing."""
    warnings.warn(f"{optimizer}({keyword}=...) is accepted for compatibility with the original "
                  f"AutoXLA but has no effect here: {why}", UserWarning, stacklevel=3)


def warn_if_stacked_layers(optimizer) -> None:
    """One warning when ``optimizer`` holds decoder layers AutoXLA stacked (scan_layers=True):
    CAME's update clipping and SM3's accumulators then span all layers of a tensor at once,
    where an unstacked model has them per layer (Lion and other element-wise rules are the same
    either way)."""
    stacked = [p for g in optimizer.param_groups for p in g["params"]
               if getattr(p, "autoxla_stacked_layers", None)]
    if stacked:
        name = type(optimizer).__name__
        warnings.warn(
            f"{name}: {len(stacked)} parameter(s) hold {stacked[0].autoxla_stacked_layers} "
            f"decoder layers each, stacked by AutoXLA's scan (scan_layers=True); {name}'s "
            "statistics then span the layers of each tensor together, where the same model "
            "unstacked keeps them per layer. Load with scan_layers=False for per-layer "
            f"{name} (docs/optim.md)", UserWarning, stacklevel=3)
