"""Optimizers for XLA training: Lion, CAME and SM3, and a wrapper that cuts the graph per step.

The update rules are pytorch_optimizer's (kozistr/pytorch_optimizer, pinned in
requirements.lock); the classes here only accept the original AutoXLA's constructor keywords and
defaults (docs/optim.md lists the mapping). Each is checked against a float64 implementation of
its paper's update rule (tests/optim/reference.py), also on 8 devices under FSDPv2.

The original's submodules exist too: ``AutoXLA.optim.lion``, ``.came``, ``.sm3``,
``.optim_wrapper``.
"""
from .came import CAME
from .lion import Lion
from .optim_wrapper import XLAOptimizerWrapper
from .sm3 import SM3

__all__ = ["CAME", "Lion", "SM3", "XLAOptimizerWrapper"]
