"""Replacing submodules without leaving stale references behind.

Some models also keep their layers in a plain Python list next to the registered children
(Mask2Former's ``PredictionBlock``: ``self.layers = [nn.Linear(...), act]`` plus ``add_module``)
and call through the list. Swapping the registered child (quantized or einsum linears) would
leave the list calling the old layer, whose weights were never loaded.
"""
from __future__ import annotations

import contextlib

from torch import nn


@contextlib.contextmanager
def repointing_references(model: nn.Module):
    """Inside the block, replace submodules freely; on exit every list, tuple or dict attribute
    that held a replaced module holds its replacement."""
    before = dict(model.named_modules())
    yield
    after = dict(model.named_modules())
    replaced = {id(old): after[name] for name, old in before.items()
                if name in after and after[name] is not old}
    if not replaced:
        return
    for module in model.modules():
        for key, value in list(vars(module).items()):
            if key.startswith("_"):          # _modules, _parameters, ...: torch's own state
                continue
            if isinstance(value, list):
                value[:] = [replaced.get(id(v), v) for v in value]
            elif isinstance(value, tuple) and any(id(v) in replaced for v in value):
                setattr(module, key, type(value)(replaced.get(id(v), v) for v in value))
            elif isinstance(value, dict) and not isinstance(value, nn.Module):
                for k, v in value.items():
                    if id(v) in replaced:
                        value[k] = replaced[id(v)]
