"""The decoder stack as one loop: its layers' tensors stacked, run by torch_xla's scan.

After loading, ``stack_decoder`` replaces the decoder ``ModuleList`` with a
``StackedDecoderLayers``: every layer tensor becomes one ``[layers, ...]`` tensor (sharded as the
layer's plan says, with the layer axis unsplit), and the layer modules stay as weightless shells
that keep their attributes and hooks. A program then holds one layer (or one group of layers, for
stacks such as Gemma 2's sliding/global pairs) inside an XLA While loop: compile time and the
temporaries alive at once (converted or dequantized weights, activations) stop growing with depth.
When the plan scans from layer ``start`` (DeepSeek-V3's dense first layers differ from its
mixture-of-experts ones), layers 0..start-1 stay whole modules, run unrolled before the loop, and
only layers start.. are stacked (``[layers - start, ...]``); layer ``i`` of the loop is row
``i - start``, while the KV cache keeps one slot per layer, prefix included.

transformers' model code is unchanged: it still loops ``for layer in self.layers[:n]``. The slice
returns one recorder per layer; each records its call and hands the hidden states through, and
the last one runs the whole loop with what was recorded (each layer's mask, rotary embeddings,
cache). Calls the loop cannot express run the same layers one by one from the stacked tensors
(``unrolled``): hooks on a layer (transformers' output_hidden_states), a cache other than
generation's static one or an empty dynamic one, a slice the groups do not tile.

Backward (training): the loop saves only each step's input hidden states and recomputes the
step's forward inside a reverse loop (layer-wise rematerialisation, as gradient checkpointing),
so activation memory is one layer's plus ``layers x hidden`` inputs, whatever the depth; only the
stacked tensors that train get gradients.

Tensors added to the layers after loading (peft's LoRA adapters: peft wraps the shells'
projections, whose weights then read ``...q_proj.base_layer.weight``) are stacked too, by
``stack_new_tensors`` (``AutoXLA.training.shard_adapters`` calls it); until then the stack
refuses to run, since its one traced layer would use the first layer's copy for every layer.

One module at ~750 lines on purpose: the stacking, the recorders, the loop and its backward
share the recorded-call format and the stacked tensors' layout; split, each half would have to
know the other's internals.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from .. import _native, backend
from ..attention.hf import KernelMask
from ..sharding.decoder_stack import StackPlan, find_stack
from ..generation.stacked_cache import StackedStaticCache, StepCache

logger = logging.getLogger("AutoXLA")


class StackedTensors(nn.Module):
    """Holds the stacked ``[layers, ...]`` tensors of the scanned layers, never called. Flat: each
    tensor sits under its path in the layer with "/" for "." (``self_attn/q_proj/weight``), so no
    module here is named like a layer's module. peft finds the projections it wraps by module
    name (``...q_proj``) and must find only the layers' own (modeling/scan.py's module doc)."""


def _key(name: str) -> str:
    """A layer tensor's name (``self_attn.q_proj.weight``) as StackedTensors holds it."""
    return name.replace(".", "/")


class StackedDecoderLayers(nn.Module):
    """Stands in for the decoder ModuleList: ``len``, indexing and slicing as a list of layers.
    Its children ``0..layers-1`` are the layer modules: the prefix's (before ``plan.start``)
    whole, the others weightless shells reading ``stacked``."""

    def __init__(self, layers: list[nn.Module], stacked: StackedTensors, plan: StackPlan):
        super().__init__()
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)
        self.stacked = stacked
        self.stack_plan = plan
        self.output_hook = None      # set by wrap: activation sharding of each layer's output
        self.last_mode = ""          # "scanned" or "unrolled: <why>", for tests and the CLI
        self._layout_cache = None    # (_module_tree_version() when made, _Layout)
        # state_dict() speaks transformers' per-layer names; load_state_dict takes them back.
        self._register_state_dict_hook(_unstack_state)
        self._register_load_state_dict_pre_hook(_restack_state, with_module=True)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """Every layer on ``hidden_states`` with the same keyword arguments (transformers' model
        code calls the layers one by one instead: see ``__getitem__``)."""
        for layer in self:
            hidden_states = layer(hidden_states, **kwargs)
        return hidden_states

    # -- the list interface transformers' model code uses ----------------------------------
    def __len__(self) -> int:
        return self.stack_plan.layers

    def __iter__(self):
        return iter(self[:])

    def __getitem__(self, index):
        if isinstance(index, slice):
            indices = range(len(self))[index]
            # The prefix layers are whole modules: the model's code calls them itself, in front
            # of the recorders of the scanned part.
            k = sum(1 for i in indices if i < self.stack_plan.start) if indices.step > 0 else 0
            return [*(self.shells[i] for i in indices[:k]), *_Recorders(self, indices[k:])]
        return self._modules[str(range(len(self))[index])]

    @property
    def shells(self) -> list[nn.Module]:
        """Every layer module (the prefix's whole, the rest shells), by layer index."""
        return [self._modules[str(i)] for i in range(len(self))]

    @property
    def scanned_layers(self) -> range:
        """The layer indices whose tensors are stacked: layer ``i`` is row ``i - start``."""
        return range(self.stack_plan.start, len(self))

    def stacked_tensors(self) -> dict[str, torch.Tensor]:
        """Per-layer name (``self_attn.q_proj.weight``) -> its ``[layers, ...]`` tensor. The names
        are the layer modules' paths now: once peft wraps a projection its weight is
        ``self_attn.q_proj.base_layer.weight``, as in the unscanned peft model."""
        held = {**self.stacked._parameters, **self.stacked._buffers}
        return {name: held[key] for name, key in self._layout().links.items()}

    def stacked_keys(self) -> dict[str, str]:
        """Per-layer name -> the key StackedTensors holds its tensor under (``stacked.<key>`` in
        the model's parameter names)."""
        return dict(self._layout().links)

    def _layout(self) -> "_Layout":
        # Recomputed only when a module was set anywhere since (peft wraps or unwraps a
        # projection by setting it): one counter read per forward, not a walk of every layer.
        version = _module_tree_version()
        if self._layout_cache is None or self._layout_cache[0] != version:
            start = self.stack_plan.start
            links, loose = {}, []
            for path, m in self.shells[start].named_modules():
                stacked = m.__dict__.get("_autoxla_stacked")
                for leaf in stacked[3] if stacked else ():
                    links[f"{path}.{leaf}" if path else leaf] = stacked[1] + leaf
            for i in self.scanned_layers:
                loose += [f"{i}.{name}" for name in _own_tensors(self.shells[i])]
            # Parameters, then buffers, each in module order: the order the per-layer names
            # are saved in, which `autoxla quantize` writes too (test_offline: byte-equal files).
            params = self.stacked._parameters
            links = {**{n: k for n, k in links.items() if k in params},
                     **{n: k for n, k in links.items() if k not in params}}
            self._layout_cache = (version, _Layout(links, tuple(loose)))
        return self._layout_cache[1]

    def release_unread(self) -> list[str]:
        """Drops the stacked tensors that no layer module reads any more (peft's adapters once
        its wrappers are gone, merged or not); returns their keys."""
        read = set(self._layout().links.values())
        gone = [k for k in (*self.stacked._parameters, *self.stacked._buffers) if k not in read]
        for key in gone:
            self.stacked._parameters.pop(key, None)
            self.stacked._buffers.pop(key, None)
        return gone

    def stack_new_tensors(self, spec_of, mesh) -> list[str]:
        """Moves the tensors added to the scanned layers since loading (peft's LoRA adapters)
        into the stack, ``[layers, ...]`` each, placed as ``spec_of(per-layer name)`` says with
        the layer axis unsplit; returns their per-layer names. Until then the loop cannot run:
        its one traced layer would use the first layer's copy for every layer."""
        shells = self.shells[self.stack_plan.start:]
        held = [sorted(_own_tensors(shell)) for shell in shells]
        odd = next((i for i, names in enumerate(held) if names != held[0]), None)
        if odd is not None:
            raise ValueError(
                f"the scanned decoder layers hold different new tensors (layer "
                f"{self.stack_plan.start}: {held[0][:2]}..., layer {self.stack_plan.start + odd}: "
                f"{held[odd][:2]}...), so one traced layer cannot run them all: LoRA on some "
                "layers only (peft's layers_to_transform)? Target every layer, or load with "
                "scan_layers=False")
        names = _stack_into(self.stacked, shells, spec_of, mesh)
        self._layout_cache = None
        return names

    def per_layer_items(self, prefix: str):
        """(``{prefix}{i}.{name}``, layer i's slice) for every stacked tensor: the names and
        tensors of the unstacked model, for saving and for checks against the plan."""
        stacked = self.stacked_tensors()
        for row, i in enumerate(self.scanned_layers):
            for name, t in stacked.items():
                yield f"{prefix}{i}.{name}", t[row]

    # -- running ---------------------------------------------------------------------------
    def run(self, indices: range, calls: list["_Call"]) -> torch.Tensor:
        loose = self._layout().loose
        if loose:
            layer, _, name = loose[0].partition(".")
            raise RuntimeError(
                f"decoder layer {layer} holds {name} (and {len(loose) - 1} more tensors) "
                "outside the scanned stack, added after loading (peft's "
                "get_peft_model adds the LoRA adapters so): call AutoXLA.training."
                "shard_adapters(model) after get_peft_model and before making the optimizer, "
                "which stacks them with their layers")
        why = self._why_unrolled(indices, calls)
        if not why:
            frozen = _freeze([c.without_cache() for c in calls[:self.stack_plan.group]])
            if torch.is_grad_enabled() and any(t.requires_grad for t in frozen[0]):
                why = "an argument of the layers requires gradients"
        self.last_mode = "unrolled: " + why if why else "scanned"
        if why:
            logger.debug("decoder stack runs unrolled: %s", why)
            return self._unrolled(indices, calls)
        return self._scanned(indices, calls, *frozen)

    def _why_unrolled(self, indices: range, calls: list["_Call"]) -> str:
        plan, group = self.stack_plan, self.stack_plan.group
        if not plan.scanned:
            return plan.reason
        if (indices.step != 1 or indices.start < plan.start or (indices.start - plan.start) % group
                or len(indices) % group):
            return f"layers {indices.start}..{indices.stop - 1} are not whole groups of {group}"
        if _hooks_fire(self.shells[plan.start:]):     # the prefix's hooks run as usual
            return "hooks on the decoder layers (e.g. output_hidden_states)"
        for k in range(group, len(calls)):
            if not _same_call(calls[k], calls[k % group]):
                return f"layer {indices[k]} is called with arguments unlike layer {indices[k % group]}'s"
        cache = calls[0].cache
        if cache is not None and not (isinstance(cache, StackedStaticCache)
                                      or _empty_dynamic(cache, indices)):
            return f"a {type(cache).__name__} that is not empty"
        if torch.is_grad_enabled():
            if isinstance(cache, StackedStaticCache):
                return "a static cache while computing gradients"
            if self.training and _has_dropout(self.shells[indices.start]):
                return "dropout in training (its recomputation in the backward would differ)"
        return ""

    def _unrolled(self, indices: range, calls: list["_Call"]) -> torch.Tensor:
        stacked, start = self.stacked_tensors(), self.stack_plan.start
        hidden = calls[0].hidden
        cache = calls[0].cache
        for i, call in zip(indices, calls):
            # A prefix layer (only in a reversed slice) is a whole module: no weights to put in.
            weights = {n: t[i - start] for n, t in stacked.items()} if i >= start else {}
            hidden = _call_layer(self.shells[i], weights, hidden, call.args, call.kwargs)
            if self.output_hook is not None:
                self.output_hook(hidden)
        if isinstance(cache, StackedStaticCache):
            cache.advance(calls[0].new_tokens())
        return hidden

    def _scanned(self, indices: range, calls: list["_Call"], consts, rebuild) -> torch.Tensor:
        group, start = self.stack_plan.group, self.stack_plan.start
        rows = range(indices.start - start, indices.stop - start)   # the cache's are `indices`
        stacked = {n: _steps(t, rows, group) for n, t in self.stacked_tensors().items()}
        step = _Step(self.shells[indices.start:indices.start + group], calls[0].cache_slot, rebuild,
                     self.output_hook)
        hidden, cache = calls[0].hidden, calls[0].cache
        if torch.is_grad_enabled():      # only an empty dynamic cache gets here (_why_unrolled)
            step = replace(step, collect=cache is not None)
            hidden, keys, values = _RematScan.apply(step, hidden, consts, tuple(stacked),
                                                    *stacked.values())
            if cache is not None:
                _fill_dynamic(cache, indices, keys, values)
            return hidden
        if isinstance(cache, StackedStaticCache):
            kv = (_steps(cache.keys, indices, group), _steps(cache.values, indices, group))
            # The fill level enters as a loop input, like everything the body reads: a tensor
            # the body only captured would be lowered from its device buffer, which may still be
            # pending while the previous step runs (a crash in torch_xla's lowering).
            (hidden, _, _), (keys, values) = backend.scan_loop(
                step.infer, (hidden, consts, cache.cumulative_length), (stacked, kv))
            cache.replace_layers(indices, keys.flatten(0, 1), values.flatten(0, 1))
            cache.advance(calls[0].new_tokens())
            return hidden
        collect = cache is not None
        step = replace(step, collect=collect)
        (hidden, _, _), out = backend.scan_loop(step.infer, (hidden, consts, None), (stacked, ()))
        if collect:
            _fill_dynamic(cache, indices, *out)
        return hidden


def _fill_dynamic(cache, indices: range, keys, values) -> None:
    """An empty dynamic cache: each layer takes its keys and values ([steps, group, ...]) by its
    own update, as if the layers had run one by one."""
    keys, values = keys.flatten(0, 1), values.flatten(0, 1)
    for k, i in enumerate(indices):
        cache.update(keys[k], values[k], i)      # the Cache adds lazily created layers


def _unstack_state(module, state, prefix, local_metadata):
    for name in [k for k in state if k.startswith(prefix + "stacked.")]:
        del state[name]
    state.update((k, t.detach()) for k, t in module.per_layer_items(prefix))
    return state


def _restack_state(module, state, prefix, local_metadata, strict, missing, unexpected, errors):
    # The prefix layers' names stay: those layers are whole modules and load their own; so do
    # tensors a scanned layer holds itself (peft's adapters before shard_adapters stacks them).
    keys = module.stacked_keys()
    by_name: dict[str, dict[int, str]] = {}
    for key in list(state):
        head, _, rest = key[len(prefix):].partition(".")
        if (key.startswith(prefix) and head.isdigit() and int(head) in module.scanned_layers
                and rest in keys):
            by_name.setdefault(rest, {})[int(head)] = key
    for rest, names in by_name.items():
        state[f"{prefix}stacked.{keys[rest]}"] = torch.stack([state.pop(names[i])
                                                             for i in sorted(names)])


def _own_tensors(shell: nn.Module):
    """The names of the tensors ``shell``'s modules hold themselves (a shell holds none until
    something adds them after loading)."""
    for path, m in shell.named_modules():
        for n, t in (*m._parameters.items(), *m._buffers.items()):
            if t is not None:
                yield f"{path}.{n}" if path else n


_TREE_VERSION = [0]


def _count_module_set(module, name, value):
    _TREE_VERSION[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_module_set)


def _module_tree_version() -> int:
    """How many times a module was set as another's child, in this process (torch's global
    module registration hook): unchanged means no layer was wrapped or unwrapped since."""
    return _TREE_VERSION[0]


@dataclass(frozen=True)
class _Layout:
    links: dict          # per-layer name (its module path now) -> StackedTensors key
    loose: tuple         # tensors a scanned layer holds itself (none, but added after loading)


@dataclass
class _Call:
    hidden: torch.Tensor
    args: tuple
    kwargs: dict

    @property
    def cache_slot(self):
        """Where the layer is handed its cache: ("kw", name) (``cache``, ``past_key_values``,
        GPT-NeoX's ``layer_past``), ("arg", index) (GPT-2 passes it positionally), or None.
        Found by type: a cache object must never enter the loop body, whose tensors it would
        keep after the loop is traced (their use then crashed the process)."""
        from transformers.cache_utils import Cache

        for k, v in self.kwargs.items():
            if isinstance(v, Cache):
                return ("kw", k)
        for i, v in enumerate(self.args):
            if isinstance(v, Cache):
                return ("arg", i)
        return None

    @property
    def cache(self):
        slot = self.cache_slot
        if slot is None:
            return None
        return self.kwargs[slot[1]] if slot[0] == "kw" else self.args[slot[1]]

    def without_cache(self) -> tuple[tuple, dict]:
        """(args, kwargs) with the cache left out (None in its positional place)."""
        slot = self.cache_slot
        if slot is None:
            return self.args, self.kwargs
        if slot[0] == "kw":
            return self.args, {k: v for k, v in self.kwargs.items() if k != slot[1]}
        return self.args[:slot[1]] + (None,) + self.args[slot[1] + 1:], self.kwargs

    def new_tokens(self) -> int:
        return self.hidden.shape[1]


class _Recorders(list):
    """One callable per layer of a slice; the last call runs them all (see the module doc)."""

    def __init__(self, stack: StackedDecoderLayers, indices: range):
        super().__init__(_Recorder(self, k) for k in range(len(indices)))
        self.stack, self.indices, self.calls = stack, indices, []

    def record(self, k: int, args: tuple, kwargs: dict) -> torch.Tensor:
        if "hidden_states" in kwargs:
            hidden = kwargs.pop("hidden_states")
        elif args:
            hidden, args = args[0], args[1:]
        else:
            raise TypeError("a decoder layer was called without hidden states")
        if k != len(self.calls):
            raise RuntimeError("decoder layers were called out of order; load with scan_layers=False")
        if self.calls and hidden is not self.calls[0].hidden:
            raise RuntimeError(
                "the model changes the hidden states between decoder layers, which a scanned "
                f"stack cannot express ({type(self.stack).__name__}); load it with "
                "scan_layers=False")
        self.calls.append(_Call(hidden, args, kwargs))
        if k < len(self) - 1:
            return hidden
        calls, self.calls = self.calls, []
        return self.stack.run(self.indices, calls)


class _Recorder:
    def __init__(self, owner: _Recorders, k: int):
        self.owner, self.k = owner, k

    def __call__(self, *args, **kwargs):
        return self.owner.record(self.k, args, kwargs)


@dataclass
class _Step:
    """One loop step: ``group`` layers, each with its own weights slice and recorded arguments."""

    shells: list
    cache_slot: tuple | None      # where each layer takes its cache (_Call.cache_slot)
    rebuild: object               # consts -> per-layer (args, kwargs), without the cache
    output_hook: object = None
    collect: bool = False                     # return each layer's new keys and values

    def layers(self, hidden, consts, weights, kv=None, fill=None):
        arguments = self.rebuild(consts)
        new_keys, new_values = [], []
        for j, shell in enumerate(self.shells):
            cache = None
            if kv is not None:
                cache = StepCache(kv[0][j], kv[1][j], fill)
            elif self.collect:
                cache = StepCache(None, None, None)
            args, kw = _with_cache(*arguments[j], self.cache_slot, cache)
            hidden = _call_layer(shell, {n: w[j] for n, w in weights.items()}, hidden, args, kw,
                                 in_loop=True)
            if self.output_hook is not None:
                self.output_hook(hidden)
            if cache is not None:
                new_keys.append(cache.keys)
                new_values.append(cache.values)
        ys = (torch.stack(new_keys), torch.stack(new_values)) if new_keys else ()
        return hidden, ys

    def infer(self, carry, x):
        hidden, consts, fill = carry
        weights, kv = x
        hidden, ys = self.layers(hidden, consts, weights, kv if kv else None, fill)
        return (hidden, consts, fill), ys


class _RematScan(torch.autograd.Function):
    """Forward: the loop, keeping each step's input. Backward: a reverse loop that recomputes
    each step with autograd on and returns the gradients of its input and its weights."""

    @staticmethod
    def forward(ctx, step: _Step, hidden, consts, names, *weights):
        weights = dict(zip(names, weights))

        def fwd(carry, w):
            h, c = carry
            out, kv = step.layers(h, c, w)
            return (out, c), (h, kv)

        with torch.no_grad():
            (out, _), (inputs, kv) = backend.scan_loop(fwd, (hidden, consts), weights)
        ctx.step, ctx.consts, ctx.names = replace(step, collect=False), consts, names
        # Only the weights that train get a gradient: a frozen base (LoRA) or a quantized one
        # (integer codes) would otherwise cost a [layers, ...] gradient of every weight.
        ctx.trains = ctx.needs_input_grad[4:]
        ctx.save_for_backward(inputs, *weights.values())
        keys, values = kv if kv else (out.new_empty(0), out.new_empty(0))
        ctx.mark_non_differentiable(keys, values)   # a training forward's cache is detached
        return out, keys, values

    @staticmethod
    def backward(ctx, grad_out, _grad_keys, _grad_values):
        inputs, *weights = ctx.saved_tensors
        step, names, trains = ctx.step, ctx.names, ctx.trains

        def bwd(carry, x):
            grad, consts = carry
            w, h = x
            with torch.enable_grad():
                h = h.detach().requires_grad_(True)
                w = {n: t.detach().requires_grad_(train) for (n, t), train in zip(w.items(), trains)}
                wrt = [h, *(t for t, train in zip(w.values(), trains) if train)]
                out, _ = step.layers(h, consts, w)
                grads = torch.autograd.grad(out, wrt, grad, allow_unused=True)
            grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, wrt)]
            return (grads[0], consts), tuple(grads[1:])

        with torch.no_grad():
            (grad_hidden, _), grad_trained = backend.scan_loop(
                bwd, (grad_out, ctx.consts), (dict(zip(names, weights)), inputs), reverse=True)
        grad_trained = iter(grad_trained)
        grad_weights = [next(grad_trained) if train else None for train in trains]
        return (None, grad_hidden, None, None, *grad_weights)


# -- building the stack -------------------------------------------------------------------------

def stack_decoder(model: nn.Module, stack_plan: StackPlan, plan, mesh) -> StackedDecoderLayers:
    """Replace the loaded decoder ModuleList with its stacked form (one tensor name at a time, so
    host and device memory hold at most one extra stacked tensor). Layers before
    ``stack_plan.start`` keep their tensors: they run unrolled, as loaded."""
    path, layers = find_stack(model)
    start = stack_plan.start
    stacked = StackedTensors()
    _stack_into(stacked, list(layers)[start:], lambda name: plan[f"{path}.{start}.{name}"].spec,
                mesh)
    stack = StackedDecoderLayers(list(layers), stacked, stack_plan)
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, attr, stack)
    return stack


def _stack_into(holder: StackedTensors, shells: list, spec_of, mesh) -> list[str]:
    """Every tensor the ``shells`` hold, moved into ``holder`` as one ``[layers, ...]`` tensor per
    name (one name at a time, so that memory holds at most one extra stacked tensor), sharded as
    ``spec_of(name)`` with the layer axis unsplit; the shells' modules then read their row of it.
    Returns the per-layer names, in the layer's module order."""
    names, leaves = [], {}
    seen: set[int] = set()
    for owner_path, m in shells[0].named_modules():
        held = [(n, t, True) for n, t in m._parameters.items()]
        held += [(n, t, False) for n, t in m._buffers.items()]
        for leaf, t, is_param in held:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            names.append((owner_path, leaf, is_param))
            leaves.setdefault(owner_path, []).append(leaf)
    for owner_path, leaf, is_param in names:
        name = f"{owner_path}.{leaf}" if owner_path else leaf
        owners = [s.get_submodule(owner_path) if owner_path else s for s in shells]
        tensors = [(o._parameters if is_param else o._buffers)[leaf] for o in owners]
        requires_grad = tensors[0].requires_grad
        value = torch.stack([t.detach() for t in tensors])
        if value.device.type == "xla":     # the layer's planned spec, the layer axis unsplit
            backend.mark_sharding(value, mesh, (None, *spec_of(name)))
        persistent = leaf not in owners[0]._non_persistent_buffers_set
        for o in owners:
            del (o._parameters if is_param else o._buffers)[leaf]
        del tensors
        if is_param:
            param = nn.Parameter(value, requires_grad=requires_grad)
            # Dim 0 counts layers, not features: optimizers whose statistics span a tensor's
            # dimensions (CAME, SM3) read it (AutoXLA/optim/_keywords.py).
            param.autoxla_stacked_layers = len(shells)
            holder.register_parameter(_key(name), param)
        else:
            holder.register_buffer(_key(name), value, persistent=persistent)
        if value.device.type == "xla":
            # Run the stack now and wait for it: the per-layer tensors are freed as it ends.
            # XLA:CPU's buffers are host memory from many threads' malloc arenas, which keep
            # what is freed: without the trim a 7B model's RSS grows by ~6 GiB over these steps.
            backend.sync()
            backend.wait_for_transfers()
            _native.release_freed_host_memory()
    for row, shell in enumerate(shells):
        for owner_path, held in leaves.items():
            owner = shell.get_submodule(owner_path) if owner_path else shell
            _read_through(owner, holder, _key(owner_path) + "/" if owner_path else "", row, held)
    return [f"{p}.{leaf}" if p else leaf for p, leaf, _ in names]


def _read_through(module: nn.Module, holder: StackedTensors, prefix: str, row: int,
                  leaves: list[str]) -> None:
    """``module.<leaf>`` (each tensor it gave to the stack) reads ``holder``'s ``prefix + leaf``
    at ``row``: a shell still answers ``layers[3].mlp.down_proj.weight`` with that layer's
    current values. Done by a subclass of the module's own class (isinstance and type names
    unchanged) whose ``__getattr__``, which Python calls only when normal lookup fails, looks in
    the stack."""
    cls = type(module)
    if not getattr(cls, "_autoxla_read_through", False):
        cls = _READ_THROUGH.get(cls)
        if cls is None:
            cls = _READ_THROUGH[type(module)] = type(type(module).__name__, (type(module),), {
                "__getattr__": _stacked_getattr, "_autoxla_read_through": True,
                "__module__": type(module).__module__})
        module.__class__ = cls
    before = module.__dict__.get("_autoxla_stacked")
    known = tuple(before[3]) if before else ()
    module.__dict__["_autoxla_stacked"] = (holder, prefix, row, known + tuple(leaves))


_READ_THROUGH: dict[type, type] = {}


def _stacked_getattr(self, name: str):
    holder, prefix, row, leaves = self.__dict__.get("_autoxla_stacked", (None, "", 0, ()))
    if name in leaves:
        return getattr(holder, prefix + name)[row]
    return super(type(self), self).__getattr__(name)


def stack_of(model: nn.Module) -> StackedDecoderLayers | None:
    """The model's stacked decoder, if it has one."""
    for m in model.modules():
        if isinstance(m, StackedDecoderLayers):
            return m
    return None


# -- helpers ---------------------------------------------------------------------------------

def _call_layer(shell, weights, hidden, args, kwargs, in_loop: bool = False):
    """``shell(hidden, ...)`` with ``weights`` (per-layer name -> tensor) in place for the call.
    They go into the owning modules' ``__dict__`` (the shells hold no parameters, so plain
    attribute lookup finds them first) and are removed after; torch.func.functional_call would
    instead restore what the read-through attribute returned as a stale plain attribute.
    ``in_loop``: transformers' per-layer gradient checkpointing (gradient_checkpointing_enable,
    which TRL calls) is off for the call: the loop already recomputes each layer, and a
    re-entrant checkpoint inside its backward would hide the weights' gradients from it."""
    placed = []
    checkpointing = shell.__dict__.get("gradient_checkpointing")
    if in_loop and checkpointing:
        shell.__dict__["gradient_checkpointing"] = False
    try:
        for name, t in weights.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = shell.get_submodule(owner_path) if owner_path else shell
            owner.__dict__[leaf] = t
            placed.append((owner, leaf))
        out = shell(hidden, *args, **kwargs)
    finally:
        for owner, leaf in placed:
            owner.__dict__.pop(leaf, None)
        if in_loop and checkpointing:
            shell.__dict__["gradient_checkpointing"] = checkpointing
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{type(shell).__name__} returns {type(out).__name__}, not the hidden "
                        "states tensor a scanned stack carries; load with scan_layers=False")
    return out


def _steps(t: torch.Tensor, indices: range, group: int) -> torch.Tensor:
    """``[layers, ...]`` -> ``[steps, group, ...]`` over ``indices``."""
    if len(indices) != t.shape[0]:
        t = t[indices.start:indices.stop]
    return t.reshape(len(indices) // group, group, *t.shape[1:])


def _same_call(a: _Call, b: _Call) -> bool:
    if a.args != b.args or a.kwargs.keys() != b.kwargs.keys():
        return False
    return all(_same(a.kwargs[k], b.kwargs[k]) for k in a.kwargs)


def _same(x, y) -> bool:
    if x is y:
        return True
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return False
    try:
        return bool(x == y)
    except Exception:
        return False


def _hooks_fire(shells) -> bool:
    """Would a hook on a layer run in this call? transformers installs its output-capturing hooks
    once and leaves them in place, inert unless this forward collects outputs."""
    hooks = [h for s in shells for h in (*s._forward_hooks.values(), *s._forward_pre_hooks.values())]
    if not hooks:
        return False
    if any(getattr(h, "__name__", "") != "output_capturing_hook" for h in hooks):
        return True
    from transformers.utils.output_capturing import _active_collector

    return bool(_active_collector.get())


def _empty_dynamic(cache, indices: range) -> bool:
    """A DynamicCache that holds nothing yet for the layers ``indices`` (the prefix layers, run
    before, have filled theirs; layers may not even exist: a cache built without a config adds
    them as they are first updated)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or not isinstance(cache, DynamicCache):
        return False
    return all(isinstance(layers[i], DynamicLayer) and not layers[i].is_initialized
               for i in indices if i < len(layers))


def _has_dropout(layer: nn.Module) -> bool:
    for m in layer.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        p = getattr(m, "attention_dropout", 0.0)
        if isinstance(p, float) and p > 0:
            return True
    return False


def _with_cache(args: tuple, kwargs: dict, slot, cache) -> tuple[tuple, dict]:
    """A layer's arguments with ``cache`` at ``slot`` (keyword arguments without it when there is
    no cache, as transformers' own calls without one)."""
    if slot is None or (cache is None and slot[0] == "kw"):
        return args, kwargs
    if slot[0] == "kw":
        return args, {**kwargs, slot[1]: cache}
    return args[:slot[1]] + (cache,) + args[slot[1] + 1:], kwargs


def _freeze(arguments: list[tuple[tuple, dict]]):
    """The tensors in the layers' arguments but the cache (each once), and a function rebuilding
    the arguments from a same-ordered list of tensors. They enter the loop as inputs; a tensor the loop body
    only captured would be recomputed from its graph at every step. A KernelMask that needs its
    dense mask is built once here."""
    leaves: list[torch.Tensor] = []
    seen: dict[int, int] = {}

    def leaf(t):
        if id(t) not in seen:
            seen[id(t)] = len(leaves)
            # torch_xla's loop multiplies each input by 1 before tracing the body, which turns a
            # bool into an int64 and changes the loop's carried type: carry masks as uint8.
            leaves.append(t.to(torch.uint8) if t.dtype == torch.bool else t)
        i = seen[id(t)]
        if t.dtype == torch.bool:
            return lambda ts: ts[i].to(torch.bool)
        return lambda ts: ts[i]

    def plan(v):
        if isinstance(v, torch.Tensor):
            return leaf(v)
        if isinstance(v, KernelMask):
            window = v.window
            if v.structured:
                seg = plan(v.segment_ids)
                return lambda ts: KernelMask(_no_dense, True, window, seg(ts))
            dense = leaf(v.dense())
            return lambda ts: KernelMask(lambda: dense(ts), False, window, None)
        if isinstance(v, (tuple, list)):
            parts = [plan(x) for x in v]
            return lambda ts: type(v)(p(ts) for p in parts)
        if isinstance(v, dict):
            parts = {k: plan(x) for k, x in v.items()}
            return lambda ts: {k: p(ts) for k, p in parts.items()}
        return lambda ts: v

    # The cache is not an argument the loop carries: each step hands its layers their own.
    builders = [(plan(tuple(args)), plan(kw)) for args, kw in arguments]
    # ``plan`` refers to itself through its cell: a reference cycle that would keep ``leaves``
    # (this call's masks and rotary tensors) alive until the garbage collector runs, and a live
    # tensor is an output of the next program, which then differs from step to step.
    plan = leaf = None

    def rebuild(ts):
        return [(positional(ts), keywords(ts)) for positional, keywords in builders]

    return tuple(leaves), rebuild


def _no_dense():
    raise RuntimeError("internal error: a structured KernelMask's dense mask was asked for "
                       "inside the scanned stack; please report")
