"""Can the decoder stack run as one loop (torch_xla's scan)? The plan's answer, from structure alone.

A stack scans when its layers repeat: the same class, the same tensors (names, shapes, dtypes,
quantized formats) and the same non-tensor attributes (sliding window, layer type, attention
kernel, ...) with some period ``group`` that divides the depth. Gemma 2's alternating sliding and
global layers repeat with period 2: the loop then runs pairs. Only ``layer_idx`` may differ (the
loop hands each layer its own cache slot, so nothing reads it).

A stack whose first layers differ from the rest (DeepSeek-V3's ``first_k_dense_replace`` dense
layers before its mixture-of-experts ones) scans the rest: ``start`` is the smallest prefix (at
most half the layers) after which the layers repeat at least twice; the prefix layers run
unrolled, as ordinary modules, before the loop. Everything here is plain data: ``autoxla plan``
shows it without torch_xla.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass

import torch
from torch import nn

from .. import _native
from .configs import decoder_config, module_configs

# Attributes that legitimately differ per layer: the index (used only to pick a cache layer, which
# the scanned loop supplies) and nn.Module's own state.
_PER_LAYER = {"layer_idx", "training"}


@dataclass(frozen=True)
class StackPlan:
    path: str            # the ModuleList, e.g. "model.layers"
    layers: int
    group: int = 1       # layers per loop step (the period of their pattern)
    scanned: bool = False
    reason: str = ""     # why not, when not scanned; when scanned from start: why the prefix differs
    start: int = 0       # layers 0..start-1 run unrolled, before the loop (they differ)

    @property
    def steps(self) -> int:
        return (self.layers - self.start) // self.group if self.scanned else 0

    def describe(self) -> str:
        if not self.scanned:
            return f"decoder stack {self.path}: {self.layers} layers unrolled ({self.reason})"
        per = "1 layer" if self.group == 1 else f"{self.group} layers"
        loop = f"one loop of {self.steps} steps ({per} per step; one step compiled)"
        if not self.start:
            return f"decoder stack {self.path}: {self.layers} layers scanned as {loop}"
        return (f"decoder stack {self.path}: layers 0..{self.start - 1} unrolled ({self.reason}), "
                f"layers {self.start}..{self.layers - 1} scanned as {loop}")

    def unrolled(self, reason: str) -> "StackPlan":
        return dataclasses.replace(self, scanned=False, reason=reason)

    def rechecked(self, layers, planned: list[dict] | None = None) -> "StackPlan":
        """This plan for ``layers`` as they are now, or (``planned``: per layer, the attributes
        the attention patch will set, by module name in the layer) as they will be once some of
        them run a kernel and others stay eager: itself while they still repeat from its start
        with its group, else unrolled, saying why (``start`` is kept: a stack already built
        keeps the layers before it unstacked)."""
        if not self.scanned:
            return self
        start, group, reason = repeating_group(list(layers), planned)
        if not group:
            return self.unrolled(reason)
        if (start, group) != (self.start, self.group):
            now = f"the layers now repeat every {group} from layer {start}"
            return self.unrolled(f"{now} ({reason})" if reason else now)
        return self


def find_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList of decoder layers (transformers' ``_no_split_modules`` classes), or None.

    A vision-language model has two such lists (its vision tower's and its language model's):
    the decoder's is the one whose owning module holds the text decoder's config."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [(path, m) for path, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) and all(type(c).__name__ in names for c in m)]
    config = getattr(model, "config", None)
    if len(found) > 1 and hasattr(config, "get_text_config"):
        owners, decoder = module_configs(model, config), decoder_config(config)
        found = [(path, m) for path, m in found if owners[path] is decoder]
    return found[0] if len(found) == 1 else None


def plan_stack(model: nn.Module, enabled: bool = True,
               attention: dict[str, str] | None = None) -> StackPlan | None:
    """The StackPlan of ``model``'s decoder stack (None when it has no single one).

    ``attention``: the kernel each attention module will run, by its path ("eager": the model's
    own), when the layers do not all run the same one (attention_config['layers']): the stack
    is then checked as it will be once patched, and runs unrolled if they no longer repeat (as
    a model patched after it was stacked does: ``rechecked``)."""
    found = find_stack(model)
    if found is None:
        return None
    path, layers = found
    plan = StackPlan(path, len(layers))
    if not enabled:
        return plan.unrolled("scan_layers=False")
    start, group, reason = repeating_group(list(layers))
    if group:
        called = how_layers_are_called(model, path, len(layers))
        if called:
            return plan.unrolled(called)
        plan = dataclasses.replace(plan, group=group, scanned=True, start=start, reason=reason)
        if attention and len(set(attention.values())) > 1:
            plan = plan.rechecked(layers, _planned_attention(path, len(layers), attention))
        return plan
    return plan.unrolled(reason)


def _planned_attention(path: str, n: int, attention: dict[str, str]) -> list[dict]:
    """Per layer of the stack at ``path``: {module name in the layer: the attribute the attention
    patch sets on it} (attention/hf.py's ``autoxla_attention``; None on an eager layer)."""
    planned = []
    for i in range(n):
        prefix = f"{path}.{i}."
        planned.append({p[len(prefix):]: {"autoxla_attention": None if k == "eager" else k}
                        for p, k in attention.items() if p.startswith(prefix)})
    return planned


def how_layers_are_called(model: nn.Module, path: str, n: int) -> str:
    """"" when the model's own forward calls its decoder layers as a scanned stack can run them
    (in order, each handed the hidden states the previous one returned), else why not.

    Found by running the empty model's forward on fake tensors (no memory, no device, ~0.05 s)
    with each layer replaced by a stand-in that hands its input through: Falcon's model code,
    for example, takes ``outputs[0]`` of each layer, which a loop that carries one tensor cannot
    express. A forward that fails for another reason before the layers run (an operation fake
    tensors cannot do) decides nothing; the stack then checks at its first call (modeling/scan.py).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls: list = []
    stand_ins = nn.ModuleList(_PassThrough(calls, k) for k in range(n))
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    layers = getattr(parent, attr)
    buffers = [(m, dict(m._buffers)) for m in model.modules()]   # a forward may update rope buffers
    setattr(parent, attr, stand_ins)
    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
            ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
            model(input_ids=ids, use_cache=False)
    except Exception:    # after the layers ran (an output step) or before (undecided): see above
        pass
    finally:
        setattr(parent, attr, layers)
        for m, saved in buffers:
            m._buffers.clear()
            m._buffers.update(saved)
        # What the traced forward left (~90 MiB for a 1 GB Llama) goes back before any weight is
        # read, instead of adding to the loading peak (bench/load.py).
        _native.release_freed_host_memory()
    order = [k for k, _ in calls]
    if order and order != list(range(len(order))):
        return f"the model calls its decoder layers in the order {order[:8]}, not one after another"
    for (k, hidden), (_, previous) in zip(calls[1:], calls):
        if hidden is not previous:
            return (f"the model changes the hidden states between decoder layers (layer {k} is not "
                    f"handed what layer {k - 1} returned: its layers return a tuple the model "
                    "indexes, or the model transforms their output), which one loop carrying the "
                    "hidden states cannot express")
    return ""


class _PassThrough(nn.Module):
    """Stands in for decoder layer k in how_layers_are_called: records what it is handed."""

    def __init__(self, calls: list, index: int):
        super().__init__()
        self.calls, self.index = calls, index

    def forward(self, *args, **kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        self.calls.append((self.index, hidden))
        return hidden


def repeating_group(layers: list[nn.Module], planned: list[dict] | None = None
                    ) -> tuple[int, int, str]:
    """(start, group, why layers 0..start-1 are apart or ""): layers start.. repeat every
    ``group`` layers, at least twice. The smallest start wins, then the smallest group; the
    prefix is at most half the layers (past that, little is left to loop over).
    (0, 0, why not) when no such split exists."""
    n = len(layers)
    if n < 2:
        return 0, 0, "a single layer: nothing to loop over"
    signatures = [signature(m, planned[i] if planned else None) for i, m in enumerate(layers)]
    for start in range(n // 2 + 1):
        rest = signatures[start:]
        for period in range(1, len(rest) // 2 + 1):
            m = len(rest)
            if m % period == 0 and all(rest[i] == rest[i % period] for i in range(m)):
                return start, period, _apart(signatures, start, period)
    other = next(i for i in range(1, n) if signatures[i] != signatures[0])
    return 0, 0, (f"the layers do not repeat: layer {other} differs from layer 0 in "
                  f"{first_difference(signatures[0], signatures[other])}")


def _apart(signatures: list, start: int, group: int) -> str:
    """Why layer start-1, the last of the prefix, is not the loop's first: it differs from the
    layer at its place in the pattern, or the depth from it is no whole number of groups."""
    if not start:
        return ""
    last, twin = start - 1, start - 1 + group
    if signatures[last] != signatures[twin]:
        return (f"they differ from the rest: layer {last} differs from layer {twin} in "
                f"{first_difference(signatures[last], signatures[twin])}")
    return f"layers {last}..{len(signatures) - 1} are not whole groups of {group}"


def signature(layer: nn.Module, planned: dict | None = None) -> list:
    """What must be equal for two layers to run as the same compiled step (``planned``: the
    attributes a patch will set, by module name in the layer, as if already set)."""
    out = []
    for name, m in layer.named_modules():
        attrs = {k: _key(v) for k, v in {**vars(m), **(planned or {}).get(name, {})}.items()
                 if not k.startswith("_") and k not in _PER_LAYER}
        tensors = [(k, tuple(t.shape), str(t.dtype)) for k, t in
                   list(m._parameters.items()) + list(m._buffers.items()) if t is not None]
        out.append((name or "<layer>", type(m).__name__, sorted(attrs.items()), tensors))
    return out


def first_difference(a: list, b: list) -> str:
    for (name, cls, attrs, tensors), (_, cls2, attrs2, tensors2) in zip(a, b):
        if cls != cls2:
            return f"{name}: class {cls} vs {cls2}"
        for (k, v), (_, v2) in zip(attrs, attrs2):
            if v != v2:
                return f"{name}.{k}: {v!r} vs {v2!r}"
        if attrs != attrs2:
            return f"{name}: attributes {[k for k, _ in attrs]} vs {[k for k, _ in attrs2]}"
        if tensors != tensors2:
            return f"{name}: tensors {tensors} vs {tensors2}"
    return "structure (number of submodules)"


def _key(value):
    """Primitives, dataclasses, partials and functions compare by value; any other object by
    identity (a shared config object is the same object in every layer)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_key(v) for v in value)
    if dataclasses.is_dataclass(value):
        return value
    if isinstance(value, functools.partial):
        return ("partial", _key(value.func), _key(value.args), sorted(
            (k, _key(v)) for k, v in value.keywords.items()))
    if isinstance(value, types.FunctionType):   # same code, same captured values
        cells = tuple(_key(c.cell_contents) for c in value.__closure__ or ())
        return ("function", id(value.__code__), cells)
    if isinstance(value, types.BuiltinFunctionType):
        return ("builtin", value.__module__, value.__qualname__)
    return ("object", type(value).__name__, id(value))
