"""The original AutoXLA's optimizer keywords that have no counterpart here."""
from __future__ import annotations

import warnings


def warn_without_effect(optimizer: str, keyword: str, why: str) -> None:
    """One warning, at the caller's construction line, that ``keyword`` changes nothing."""
    warnings.warn(f"{optimizer}({keyword}=...) is accepted for compatibility with the original "
                  f"AutoXLA but has no effect here: {why}", UserWarning, stacklevel=3)
