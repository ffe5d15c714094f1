"""CAME (Luo et al. 2023, "CAME: Confidence-guided Adaptive Memory Efficient Optimization"),
pytorch_optimizer's."""
from __future__ import annotations

import pytorch_optimizer

from ._keywords import warn_if_stacked_layers


class CAME(pytorch_optimizer.CAME):
    """pytorch_optimizer's CAME with the original AutoXLA's signature: ``eps`` is the pair
    ``(eps1, eps2)`` (squared-gradient and instability constants, default ``(1e-30, 1e-16)``),
    ``betas`` the triple for the update, squared-gradient and instability averages.

    Matrices (and the last two dimensions of higher-rank tensors) keep factored row/column
    statistics (Algorithm 1 of the paper); vectors keep a full second moment and no confidence
    term, as in the paper's own code. ``weight_decay`` is decoupled (``p -= lr * wd * p``), as in
    the original. The original had no usable default learning rate (``lr=None`` failed its own
    check); pytorch_optimizer's 2e-4 is the default here. Further keywords go to pytorch_optimizer
    (``ams_bound``, ``weight_decouple``, ``fixed_decay``, ``foreach``, ``maximize``).
    """

    def __init__(self, params, lr=2e-4, eps=(1e-30, 1e-16), clip_threshold=1.0,
                 betas=(0.9, 0.999, 0.9999), weight_decay=0.0, **kwargs):
        if lr is None:
            raise ValueError("CAME needs a learning rate: pass lr=... (2e-4 is pytorch_optimizer's "
                             "default; the original AutoXLA's lr=None default raised an error too)")
        if "eps1" in kwargs or "eps2" in kwargs:
            raise TypeError("CAME takes eps=(eps1, eps2), the original AutoXLA's form; pass "
                            "eps=(...) instead of eps1=/eps2=")
        try:
            eps1, eps2 = eps
        except (TypeError, ValueError):
            raise ValueError(f"CAME's eps must be a pair (eps1, eps2) for the squared gradient and "
                             f"the instability, e.g. (1e-30, 1e-16); got {eps!r}") from None
        if len(tuple(betas)) != 3:
            raise ValueError(f"CAME's betas must be three values (update, squared gradient, "
                             f"instability), e.g. (0.9, 0.999, 0.9999); got {betas!r}")
        super().__init__(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                         clip_threshold=clip_threshold, eps1=eps1, eps2=eps2, **kwargs)
        warn_if_stacked_layers(self)
