"""Building a model without its weights: parameters on the meta device, buffers real.

Parameters are what the checkpoint supplies, so they need no memory now. Buffers stay on the CPU:
non-persistent ones (rotary ``inv_freq``) are computed in ``__init__`` and not saved, so this is the
only chance to get their values.
"""
from __future__ import annotations

import contextlib

from torch import nn


@contextlib.contextmanager
def parameters_on_meta():
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = getattr(param, "__dict__", {})
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name].__dict__.update(kwargs)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original
