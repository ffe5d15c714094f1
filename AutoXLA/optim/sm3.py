"""SM3 (Anil et al. 2019, "Memory-Efficient Adaptive Optimization"), pytorch_optimizer's."""
from __future__ import annotations

import pytorch_optimizer

from ._keywords import warn_if_stacked_layers, warn_without_effect

_UNSET = object()


class SM3(pytorch_optimizer.SM3):
    """pytorch_optimizer's SM3 with the original AutoXLA's signature and defaults.

    A rank-k tensor keeps k accumulators, one per dimension (the paper's cover by slices; a
    vector's is Adagrad's full accumulator). ``beta=0`` is the paper's SM3-II; ``beta > 0`` is
    the exponential-average variant of PyTorch-SM3, which the original also had. ``momentum``
    averages the preconditioned update, ``m = momentum * m + (1 - momentum) * u``, as in the
    original. ``eps`` defaults to the original's 1e-8 (pytorch_optimizer's is 1e-30).

    ``scale`` is accepted with a warning: the original's code for it was commented out, so it
    never had an effect there either.
    """

    def __init__(self, params, lr=0.1, momentum=0.0, beta=0.0, eps=1e-8, scale=_UNSET, **kwargs):
        if scale is not _UNSET:
            warn_without_effect("SM3", "scale",
                                "the original AutoXLA ignored it as well (its code was commented out)")
        super().__init__(params, lr=lr, momentum=momentum, beta=beta, eps=eps, **kwargs)
        warn_if_stacked_layers(self)
