"""Running a model whose tensors are DTensors laid out as the plan says.

Every parameter stays a DTensor with the plan's placements (sharded over fsdp and model, as
loaded). Each module gathers what it computes with just before it runs and drops it after (a
pre- and a post-forward hook): over the batch axes always (FSDP: the whole parameter for the rows
this rank holds), over the model axis unless the module is part of a tensor-parallel block. A
decoder layer with no tensor-parallel block inside gathers its whole subtree at once, as FSDP2
wraps a layer (``gathering_units``).

A tensor-parallel block is a module whose linears the plan splits the Megatron way: every column
linear by its output features over "model", every row linear by its input features (attention:
q/k/v then o; an MLP: gate/up then down). Its column linears then compute this rank's heads or
features, and each row linear's partial output is summed over "model" (one all-reduce); every
other module computes whole, as do fused projections (Phi-3's qkv_proj and gate_up_proj, GPT-2's
c_attn), whose local columns are not each projection's. The collectives are DTensor
redistributions, so autograd gets their transposes: gradients come back as the plan's placements
(reduce-scattered over fsdp, summed over data).

The batch: every process calls the model with the same global batch; its rows are split over
the (data, fsdp) ranks when they divide evenly (else every rank computes every row), and the
logits and loss come back whole on every rank.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ...planning.plan import Plan
from ...quantization.backends import ROW_ABSMAX
from ...quantization.packing import per_column
from ...sharding import rules
from ...sharding.decoder_stack import find_stack
from ...sharding.mesh import AXES
from .mesh import PlanMesh
from .placements import axes_of, compute_placements

BATCH_AXES = ("data", "fsdp")
_MODEL = AXES.index("model")


@dataclass(frozen=True)
class ModuleExecution:
    """How one module computes: the modules under a tensor-parallel block keep their split over
    "model"; a row linear's output is then summed over it."""

    tensor_parallel: bool = False
    row: bool = False       # a row linear of a tensor-parallel block
    column: bool = False    # a column linear of a tensor-parallel block


def tensor_parallel_blocks(model: nn.Module, plan: Plan) -> dict[str, ModuleExecution]:
    """module path -> how it computes, for the modules under tensor-parallel blocks."""
    if plan.mesh.model == 1:
        return {}
    found = {}
    for path, module in model.named_modules():
        columns, rows = [], []
        consistent = True
        for name, child in module.named_children():
            # a LoRA wrapper sits at its base layer's old path, the plan's name for its weight
            weight = f"{path}.{name}.weight" if path else f"{name}.weight"
            if weight not in plan:
                continue
            t = plan[weight]
            if t.role == rules.COLUMN:
                columns.append(name)
                consistent &= "model" in axes_of(t.spec[0])
            elif t.role == rules.ROW:
                rows.append(name)
                consistent &= "model" in axes_of(t.spec[1])
        # A fused projection's local columns are not each projection's (rules.FUSED_COLUMN_NAMES):
        # such a module computes whole, its tensors gathered over "model" too
        fused = any(name in rules.FUSED_COLUMN_NAMES for name in columns)
        if not (columns and rows and consistent) or fused:
            continue
        for sub, _ in module.named_modules():
            full = f"{path}.{sub}".strip(".") if sub else path
            found[full] = ModuleExecution(True)
        for name in columns + rows:
            found.update(_split_linear(f"{path}.{name}".strip("."), module.get_submodule(name),
                                       column=name in columns))
    return found


def _split_linear(path: str, linear: nn.Module, column: bool) -> dict[str, ModuleExecution]:
    """How a column or row linear of a tensor-parallel block computes, and, when peft's LoRA
    wraps it (``base_layer`` beside ``lora_A`` and ``lora_B``), how its adapters do, placed as
    planning/adapters.py places them: A split like the base's input, B like its output.

    Column (W split by output): A is whole on every "model" rank and B holds this rank's output
    rows, so B(A(x)) gives this rank's columns as the base does; A's input gradient is summed
    over "model" as the base's is (its copy to the block), and so is A's weight gradient (each
    rank's rows of B add to it). Row (W split by input): A holds this rank's input columns, so
    A(x) is a partial sum, summed over "model" as the base's output is; B, whole, then computes
    the same on every rank and its gradient is whole there too (not a sum over "model")."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return {path: ModuleExecution(True, column=column, row=not column)}
    found = {f"{path}.base_layer": ModuleExecution(True, column=column, row=not column)}
    for name in getattr(linear, "lora_A", {}):
        found[f"{path}.lora_A.{name}"] = ModuleExecution(True, column=column, row=not column)
        found[f"{path}.lora_B.{name}"] = ModuleExecution(column)
    return found


def gathering_units(model: nn.Module, blocks: dict) -> set[str]:
    """The decoder layers that gather all their tensors at once, as FSDP2 wraps them: one hook
    pair per layer instead of one per module (bench/runtimes.py: the hooks of a 135M model's
    ~270 modules cost ~8 % of a batch-1 decode step in one process), and one collective burst per
    layer. Only layers with no tensor-parallel block inside: those keep a hook per module, which
    sums the row linears' outputs over "model"."""
    found = find_stack(model)
    if found is None:
        return set()
    stack_path, layers = found
    units = set()
    for i, _ in enumerate(layers):
        path = f"{stack_path}.{i}" if stack_path else str(i)
        if not any(b == path or b.startswith(path + ".") for b in blocks):
            units.add(path)
    return units


def _holders(module: nn.Module) -> list[nn.Module]:
    """The modules whose tensors ``module`` gathers: itself and children gathered with it."""
    return [module] + [c for c in module.children() if getattr(c, "gathered_with_parent", False)]


def _inside(path: str, units: set[str]) -> bool:
    return any(path.startswith(u + ".") for u in units)


@dataclass(frozen=True)
class _Held:
    """A DTensor a module computes with: where it lives, the placements the module needs it in,
    and whether those differ from how it is stored (a collective each call)."""

    holder: nn.Module
    name: str
    placements: tuple
    gathered: bool


@dataclass
class _Hooks:
    """One module's pre- and post-forward hooks and what they gather, with ``how`` it computes
    (``None`` for hooks that act only while a checkpointed layer recomputes)."""

    module: nn.Module
    held: list
    how: "ModuleExecution | None"
    ids: tuple


class Executor:
    """The hooks that run ``model`` on ``mesh`` as the plan lays it out (see the module's text)."""

    def __init__(self, model: nn.Module, plan: Plan, mesh: PlanMesh):
        self.model, self.plan, self.mesh = model, plan, mesh
        self.blocks = tensor_parallel_blocks(model, plan)
        self.batch_split = False
        self._kept: dict | None = None     # in a generate call keeping them: what was gathered
        self._in_call = False              # in a generate call: parameters checked at its start
        # The batch axes as one mesh dimension: a gather over both is one collective, not two
        self.batch_mesh = mesh.device_mesh[BATCH_AXES]._flatten("batch")
        self._handles = []
        self._hooks: list[_Hooks] = []
        self._inside_registered = set()
        self._register()

    def adopt_new_tensors(self) -> None:
        """Hook the model again as it is now: tensors and modules added after loading (peft's
        LoRA wrappers and their adapters, made DTensors by ``shard_adapters``) are then gathered
        and, inside a tensor-parallel block, split like their base layer (see
        ``tensor_parallel_blocks``)."""
        self.remove()
        self._hooks.clear()
        self._inside_registered.clear()
        self.blocks = tensor_parallel_blocks(self.model, self.plan)
        self._register()

    def _register(self) -> None:
        model = self.model
        units = gathering_units(model, self.blocks)
        for path, module in model.named_modules():
            if getattr(module, "gathered_with_parent", False) or _inside(path, units):
                continue
            if path in units:
                own = self._held(list(module.modules()), ModuleExecution())
                if own:
                    self._hook(module, functools.partial(self._gather_unit, own, path),
                               functools.partial(self._release_unit, own), own,
                               ModuleExecution())
            else:
                self._hook_module(path, module)

    def _held(self, holders, how: "ModuleExecution") -> list["_Held"]:
        keep = frozenset({"model"}) if how.tensor_parallel else frozenset()
        own = []
        for holder in holders:
            for n, t in list(holder._parameters.items()) + list(holder._buffers.items()):
                if isinstance(t, DTensor):
                    wanted = compute_placements(t.placements, AXES, keep)
                    own.append(_Held(holder, n, wanted, wanted != tuple(t.placements)))
        return own

    def _hook(self, module, pre, post, held, how) -> None:
        handles = (module.register_forward_pre_hook(pre, with_kwargs=True),
                   module.register_forward_hook(post, with_kwargs=True))
        self._handles.extend(handles)
        self._hooks.append(_Hooks(module, held, how, tuple(h.id for h in handles)))

    def _hook_module(self, path: str, module, recomputed_in=None) -> bool:
        """One module gathering the tensors it holds (and those of children gathered with it);
        with ``recomputed_in`` (its decoder layer), only while that layer is checkpointed."""
        how = self.blocks.get(path, ModuleExecution())
        own = self._held(_holders(module), how)
        if not own:
            return False
        pre, post = self._gather, self._release
        if recomputed_in is not None:
            pre = _while_checkpointed(pre, recomputed_in)
            post = _while_checkpointed(post, recomputed_in)
        self._hook(module, functools.partial(pre, own, how), functools.partial(post, own, how),
                   own, None if recomputed_in is not None else how)
        return True

    def _gather_unit(self, held, path, module, args, kwargs):
        """A gathering unit's pre-hook: the whole layer gathers at once, one collective burst,
        except while transformers' gradient checkpointing recomputes the layer (training, with
        gradients): it checkpoints ``forward``, not the hooks around it, so then each module
        inside gathers for itself, inside the forward the backward pass runs again. Those hooks
        are added at the layer's first checkpointed forward; other forwards with gradients keep
        one collective burst per layer."""
        if not _checkpointed(module):
            return self._gather(held, ModuleExecution(), module, args, kwargs)
        if path not in self._inside_registered:
            self._inside_registered.add(path)
            for sub, child in module.named_modules():
                if sub and not getattr(child, "gathered_with_parent", False):
                    self._hook_module(f"{path}.{sub}", child, recomputed_in=module)
            # The layer's own tensors (if it holds any): hooked from its next call, gathered now
            if self._hook_module(path, module, recomputed_in=module):
                return self._gather(self._held(_holders(module), ModuleExecution()),
                                    ModuleExecution(), module, args, kwargs)
        return None

    def _release_unit(self, held, module, args, kwargs, output):
        if _checkpointed(module):
            return None           # its modules released their own tensors
        return self._release(held, ModuleExecution(), module, args, kwargs, output)

    # -- parameters ------------------------------------------------------------------------
    @contextlib.contextmanager
    def generating(self, keep: bool):
        """One generate call: the parameters checked once at its start, not at every step's
        forward; with ``keep``, a tensor gathered without gradients is gathered once and kept
        (every decode step would gather every layer again), which costs up to the model's
        gathered bytes on every rank until the call ends."""
        self.check_parameters()
        previous = self._kept, self._in_call
        self._kept, self._in_call = ({} if keep else None), True
        resident = []
        try:
            self._make_resident(keep, resident)
            yield
        finally:
            self._end_resident(resident)
            self._kept, self._in_call = previous

    def _make_resident(self, keep: bool, resident: list) -> None:
        """For a generate call (no gradients): the modules whose tensors stay as they are for the
        whole call (nothing to gather, or ``keep``) get them once and lose their hooks until it
        ends. A hook call per module and step is ~2 % of a one-process SmolLM2 decode step
        (bench/runtimes.py). Tensor-parallel modules keep theirs: a row linear sums its output
        over "model" in its hook. Appends to ``resident`` as it goes, for the caller to undo."""
        for hooks in self._hooks:
            if hooks.how is None or hooks.how.tensor_parallel:
                continue
            if not keep and any(h.gathered for h in hooks.held):
                continue
            for h in hooks.held:
                tensor = h.holder._parameters.get(h.name)
                if tensor is None:
                    tensor = h.holder._buffers[h.name]
                h.holder.__dict__[h.name] = self._local(tensor, h, hooks.how, grad=False)
            resident.append((hooks, _detach_hooks(hooks.module, hooks.ids)))

    def _end_resident(self, resident) -> None:
        for hooks, removed in resident:
            for h in hooks.held:
                h.holder.__dict__.pop(h.name, None)
            _restore_hooks(hooks.module, removed)

    def _local(self, t: DTensor, held: "_Held", how: ModuleExecution, grad: bool) -> torch.Tensor:
        placements = held.placements
        if not (grad and t.requires_grad):
            if held.gathered and self._kept is not None:
                key = (id(t), placements)
                if key not in self._kept:
                    self._kept[key] = t.redistribute(t.device_mesh, placements).to_local()
                return self._kept[key]
            if held.gathered:
                return t.redistribute(t.device_mesh, placements).to_local()
            # Nothing to gather and no gradient: the local piece itself, without to_local's
            # dispatch (bench/runtimes.py: a decode step reads every tensor)
            return t._local_tensor
        # Redistributed even when the placements already match: the redistribution's backward is
        # what brings the gradient to the parameter's placements (a replicated parameter's
        # gradient, partial over the batch ranks, is summed there)
        value = t.redistribute(t.device_mesh, placements)
        grads = []
        for axis, p in zip(AXES, placements):
            if axis in BATCH_AXES:
                grads.append(Partial() if self.batch_split else Replicate())
            elif isinstance(p, Shard):
                grads.append(p)
            else:   # model, gathered: inside a block each rank's heads add to its gradient
                grads.append(Partial() if how.tensor_parallel else Replicate())
        return value.to_local(grad_placements=grads)

    def _gather(self, held, how, module, args, kwargs):
        grad = torch.is_grad_enabled()
        for h in held:   # the module's own tensors, and those it reads of a child
            tensor = h.holder._parameters.get(h.name)
            if tensor is None:
                tensor = h.holder._buffers[h.name]
            h.holder.__dict__[h.name] = self._local(tensor, h, how, grad)
        if how.row and hasattr(module, "quant_format"):
            self._row_block_scales(module)
            if module.quantize_activation:   # W8A8: the whole row's max |x| on every rank
                module.__dict__[ROW_ABSMAX] = self._max_over_model
        if how.row and module.__dict__.get("bias") is not None:
            # the bias is added once, after the sum over "model"
            module.__dict__["_autoxla_row_bias"] = module.__dict__["bias"]
            module.__dict__["bias"] = None
        if how.column and torch.is_grad_enabled() and args:
            # identity forward; backward sums the input's gradient over "model"
            args = (self._copy_to_model(args[0]),) + tuple(args[1:])
        return args, kwargs

    def _row_block_scales(self, module) -> None:
        """A quantized row linear's scales (and zero points or offsets) for this rank's block of
        input columns. Where the plan splits them with the weight, the local pieces already match,
        and a per-channel value (one per output row) holds for every column; where the plan
        cannot split them (fewer blocks than model ranks), each column gets its block's value and
        this rank keeps its columns'."""
        fmt = module.quant_format
        columns = fmt.in_features // self.mesh.shape.model
        start = self.mesh.device_mesh["model"].get_local_rank() * columns
        for name in ("weight_scale", "weight_zero_point", "weight_offset"):
            value = module.__dict__.get(name)
            if (value is None or fmt.per_channel
                    or value.shape[-1] * fmt.block_size == columns):
                continue
            if fmt.ragged:
                raise NotImplementedError(
                    f"{fmt.label} has a shorter last block, which a row linear split over "
                    "'model' on the dtensor runtime does not handle yet: use a block size that "
                    "divides the layer's input features, or sharding_strategy='fsdp'")
            module.__dict__[name] = per_column(value, fmt)[..., start:start + columns]

    def _release(self, names, how, module, args, kwargs, output):
        for h in names:
            h.holder.__dict__.pop(h.name, None)
        if how.row:
            module.__dict__.pop(ROW_ABSMAX, None)
            output = self._sum_over_model(output)
            bias = module.__dict__.pop("_autoxla_row_bias", None)
            if bias is not None:
                output = output + bias
        return output

    # -- collectives -----------------------------------------------------------------------
    def _sum_over_model(self, partial: torch.Tensor) -> torch.Tensor:
        placements = [Replicate()] * len(AXES)
        placements[_MODEL] = Partial()
        summed = DTensor.from_local(partial, self.mesh.device_mesh, placements, run_check=False)
        return summed.redistribute(self.mesh.device_mesh, [Replicate()] * len(AXES)).to_local()

    def _max_over_model(self, local: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``local`` over the "model" ranks (no gradient: a W8A8
        activation scale, which torch_xla's op does not differentiate either)."""
        placements = [Replicate()] * len(AXES)
        placements[_MODEL] = Partial("max")
        with torch.no_grad():
            most = DTensor.from_local(local.detach(), self.mesh.device_mesh, placements,
                                      run_check=False)
            return most.redistribute(self.mesh.device_mesh, [Replicate()] * len(AXES)).to_local()

    def _copy_to_model(self, x: torch.Tensor) -> torch.Tensor:
        grads = [Replicate()] * len(AXES)
        grads[_MODEL] = Partial()
        whole = DTensor.from_local(x, self.mesh.device_mesh, [Replicate()] * len(AXES),
                                   run_check=False)
        return whole.to_local(grad_placements=grads)

    def check_parameters(self) -> None:
        """Refuse a parameter added after loading (peft's LoRA adapters are plain tensors) when
        several processes run the model: each would compute and train it alone, on its own rows
        or against this rank's columns only."""
        if self.mesh.shape.num_devices == 1:
            return
        for name, p in self.model.named_parameters():
            if not isinstance(p, DTensor) and "lora_" in name and self._adapters_placed():
                raise ValueError(
                    f"{name} is a LoRA adapter on a module the plan does not place (it places "
                    "the decoder layers' projections and the lm_head): with several processes "
                    "each would compute and train it alone. Leave that module out of "
                    "LoraConfig's target_modules, or run it on one process")
            if not isinstance(p, DTensor):
                raise ValueError(
                    f"{name} is not one of the tensors the dtensor runtime loaded (peft's LoRA "
                    "adapters, added after loading, are such plain tensors): with several "
                    "processes each would compute and train it alone. Call "
                    "AutoXLA.training.shard_adapters(model) after get_peft_model (it places "
                    "the adapters as the plan says); other tensors cannot be added after "
                    "loading on this runtime")

    def _adapters_placed(self) -> bool:
        """Whether ``shard_adapters`` ran: some LoRA adapter is a DTensor."""
        return any(isinstance(p, DTensor) for n, p in self.model.named_parameters()
                   if "lora_" in n)

    # -- the batch -------------------------------------------------------------------------
    def batch_ranks(self) -> int:
        return self.mesh.shape.data * self.mesh.shape.fsdp

    @contextlib.contextmanager
    def split(self, batch: int):
        """Split ``batch`` rows over the batch axes for the forward inside, when they divide."""
        previous = self.batch_split
        self.batch_split = self.batch_ranks() > 1 and batch % self.batch_ranks() == 0
        try:
            yield self.batch_split
        finally:
            self.batch_split = previous

    def local_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch tensor (under ``split``)."""
        index = self.batch_mesh.get_local_rank()
        rows = t.shape[0] // self.batch_ranks()
        return t[index * rows:(index + 1) * rows]

    def all_rows(self, local: torch.Tensor) -> torch.Tensor:
        """The global batch from every rank's rows; its gradient is this rank's rows' again."""
        whole = DTensor.from_local(local, self.batch_mesh, [Shard(0)], run_check=False)
        return whole.full_tensor()

    def sum_over_batch(self, local: torch.Tensor) -> torch.Tensor:
        total = DTensor.from_local(local, self.batch_mesh, [Partial()], run_check=False)
        return total.full_tensor()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _detach_hooks(module: nn.Module, ids: tuple) -> dict:
    """Take the hooks ``ids`` out of ``module`` for a while: each hook dict's items as they
    were, to put back in the same order (other hooks' handles still find their dicts)."""
    removed = {}
    for name in _HOOK_DICTS:
        d = getattr(module, name)
        if any(i in d for i in ids):
            removed[name] = list(d.items())
            for i in ids:
                d.pop(i, None)
    return removed


def _restore_hooks(module: nn.Module, removed: dict) -> None:
    for name, items in removed.items():
        d, before = getattr(module, name), dict(items)
        added = [(k, v) for k, v in d.items() if k not in before]   # while detached
        d.clear()
        d.update(items)
        d.update(added)


def _checkpointed(layer: nn.Module) -> bool:
    """Whether transformers checkpoints this forward of ``layer`` (its own condition)."""
    return (torch.is_grad_enabled() and layer.training
            and getattr(layer, "gradient_checkpointing", False))


def _while_checkpointed(hook, layer: nn.Module):
    """``hook`` for the forwards of ``layer`` that transformers checkpoints; not the others."""
    @functools.wraps(hook)
    def wrapped(*args, **kwargs):
        if _checkpointed(layer):
            return hook(*args, **kwargs)
        return None
    return wrapped


def run_on_the_mesh(model: nn.Module, executor: Executor) -> None:
    """Give ``model`` a forward that takes the global batch on every process (see the module's
    text): rows split over the batch axes where they divide, logits and loss whole again."""
    forward = model.forward

    @functools.wraps(forward)
    def parallel_forward(*args, **kwargs):
        if not executor._in_call:         # a generate call checks once, not at every step
            executor.check_parameters()
        first = kwargs.get("input_ids", args[0] if args else None)
        if first is None:
            first = kwargs.get("inputs_embeds")
        batch = first.shape[0]
        with executor.split(batch) as split:
            if not split:
                return forward(*args, **kwargs)
            labels = kwargs.get("labels")
            if labels is not None and "num_items_in_batch" not in kwargs:
                # transformers' causal loss: the sum over this rank's tokens divided by the whole
                # batch's count, summed over the ranks below = the loss of the whole batch
                kwargs["num_items_in_batch"] = (labels[..., 1:] != -100).sum()
            args = tuple(executor.local_rows(a) if _is_rows(a, batch) else a for a in args)
            kwargs = {k: executor.local_rows(v) if _is_rows(v, batch) else v
                      for k, v in kwargs.items()}
            out = forward(*args, **kwargs)
            if getattr(out, "logits", None) is not None:
                out.logits = executor.all_rows(out.logits)
            if getattr(out, "loss", None) is not None:
                out.loss = executor.sum_over_batch(out.loss)
            return out

    model.forward = parallel_forward


def checkpoint_layers(model: nn.Module) -> None:
    """Gradient checkpointing, transformers' own (non-reentrant torch.utils.checkpoint per decoder
    layer): in training mode each layer's activations are recomputed in the backward pass, and
    with them its gathered parameters (the gathering hooks run again inside the recomputation),
    so neither is held between the passes."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing=True: {type(model).__name__} does not support "
                         "transformers' gradient checkpointing; load without it")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.25's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _is_rows(value, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch
