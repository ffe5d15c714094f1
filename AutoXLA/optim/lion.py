"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), pytorch_optimizer's."""
from __future__ import annotations

import pytorch_optimizer

from ._keywords import warn_without_effect


class Lion(pytorch_optimizer.Lion):
    """pytorch_optimizer's Lion with the original AutoXLA's signature and defaults.

    The update is the paper's (Algorithm 2, decoupled weight decay): ``c = b1 m + (1 - b1) g``,
    ``p -= lr (sign(c) + weight_decay p)``, ``m = b2 m + (1 - b2) g``, with the original's default
    ``betas=(0.95, 0.98)`` (pytorch_optimizer's is the paper's ``(0.9, 0.99)``).

    ``scaling`` and ``nesterov_momentum`` belong to the original's variant (from GeneralSGD) and are
    accepted with a warning: with ``scaling=None`` and a constant learning rate the original
    computes exactly the paper's Lion, which is what runs here. Further keywords go to
    pytorch_optimizer (``weight_decouple``, ``fixed_decay``, ``foreach``, ``maximize``, ...).
    """

    def __init__(self, params, lr=1e-4, betas=(0.95, 0.98), scaling=None, weight_decay=0.0,
                 nesterov_momentum=0, **kwargs):
        if scaling is not None:
            warn_without_effect(
                "Lion", "scaling",
                "the betas stay constant, as in the paper. The original replaced them by "
                "max(1 - lr * scaling * (1 - beta), beta); to get that at a constant lr, pass "
                "those values as betas")
        if nesterov_momentum:
            warn_without_effect(
                "Lion", "nesterov_momentum",
                "the update is sign(c) as in the paper; the original added "
                "nesterov_momentum * grad to it, which pytorch_optimizer's Lion has no form of")
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, **kwargs)
