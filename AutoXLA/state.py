"""What AutoXLA keeps on a model it loaded, quantized or generated with: one typed holder,
``model.autoxla`` (a ``ModelState``), written only through ``record_state``.

Users read the same values under the names they already know (``model.autoxla_plan``,
``autoxla_mesh``, ``autoxla_quantization``, ``autoxla_last_generate``, ``autoxla_load``,
``autoxla_module``): ``record_state`` sets each of those to the holder's value in the same step, so
they are views of it that cannot drift (tests/test_layers.py checks nothing else writes them).
AutoXLA's own code reads the holder (``state_of``). They are not properties: a property needs the
model's class, and swapping the user's transformers class for a subclass would change what
``save_pretrained`` writes as the architecture and what pickle can load.

``model.autoxla_generation`` is not state but a setting: users assign it after loading
(docs/generation.md), so it stays a plain attribute, read at every call.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class ModelState:
    plan: Any = None             # planning.plan.Plan: where every tensor went, and why
    mesh: Any = None             # the device mesh the model is sharded over
    quantization: Any = None     # quantization.decisions.QuantizationReport, when quantized
    last_generate: Any = None    # generation.loop.GenerateStats of the last generate call
    load: Any = None             # loading.execute.LoadStats: what loading read
    module: Any = None           # on an FSDPv2 wrapper: the model it wraps
    runtime: Any = None          # the runtime executing it when not the xla one (runtimes/)


FIELDS = tuple(f.name for f in dataclasses.fields(ModelState))
# The attribute each field is also readable as: the names users' scripts already use.
LEGACY_NAMES = {name: f"autoxla_{name}" for name in FIELDS}

def state_of(model) -> ModelState:
    """``model``'s state (a new, empty one, attached to nothing, when AutoXLA never touched
    it)."""
    state = getattr(model, "__dict__", {}).get("autoxla")
    return state if isinstance(state, ModelState) else ModelState()


def record_state(model, **values) -> ModelState:
    """Sets fields of ``model``'s state, creating it on first use, and the attribute of the same
    value under each field's legacy name; returns the state."""
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise TypeError(f"ModelState has no field(s) {sorted(unknown)}; fields: {FIELDS}")
    state = state_of(model)
    model.__dict__["autoxla"] = state     # the same holder, or the new one on first use
    for name, value in values.items():
        setattr(state, name, value)
        # Through the model's own __setattr__, as the attributes always were set (nn.Module
        # registers an nn.Module value, such as a wrapper's inner model, as a submodule).
        setattr(model, LEGACY_NAMES[name], value)
    return state
