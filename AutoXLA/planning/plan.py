"""The Plan: for every tensor of a model, where it goes and why.

A plan is plain data: it needs no weights and no devices beyond their count, prints as a table,
and serialises to JSON. The loader executes it, tests check the loaded model against it.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..sharding import rules
from ..sharding.attention_heads import KernelHeads
from ..sharding.configs import module_configs
from ..sharding.decoder_stack import StackPlan, plan_stack
from ..sharding.kv_cache import KVCachePlan, attention_shape, kv_cache_for
from ..sharding.mesh import AXES, MeshShape, format_spec
from .adapters import AdapterPlan


@dataclass(frozen=True)
class TensorPlan:
    name: str            # parameter or buffer name in the (unwrapped) model
    role: str            # rules.COLUMN, rules.ROW, ...
    shape: tuple[int, ...]
    dtype: str           # dtype on the device, e.g. "bfloat16"
    spec: tuple          # partition spec over AXES, one entry per dim
    shard_shape: tuple[int, ...]
    bytes_per_device: int
    reason: str = ""     # why a dimension is replicated, or "" when the rule applied as is
    is_buffer: bool = False
    tied_to: str = ""    # the tensor this one shares storage with (e.g. lm_head -> embed_tokens)
    persistent: bool = True  # False for buffers that checkpoints do not hold (rotary inv_freq)
    # Quantized linears (quantization/linear.py): the weight entry carries the format, the matmul
    # backend and the float shape a float checkpoint holds; its scale and zero point name the
    # weight whose quantization produces them.
    quant: str = ""          # e.g. "int4 block 64 asym"
    backend: str = ""        # "pallas" | "xla_op" | "fallback"
    source_shape: tuple[int, ...] = ()
    derived_from: str = ""
    # The float tensor a float checkpoint holds under another name: a mixture-of-experts
    # projection ``experts.gate_up_proj`` quantized as ``experts.gate_up_proj.weight``.
    source_name: str = ""
    # A layer on the Pallas backend: the TPU generations torch_xla tuned its tiles for
    # (quantization/pallas_tiles.py); on the others a TPU gives it the next backend.
    pallas_tuned: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor in its device dtype."""
        return _nbytes(self.shape, self.dtype)

    @property
    def spec_str(self) -> str:
        return format_spec(self.spec)


@dataclass(frozen=True)
class LayerAttentionPlan:
    """The attention kernel of each attention module, decided on the empty model
    (attention/patch.py ``plan_attention``) and applied once the weights are loaded."""

    kernel: str                   # what the text decoder's config names: the kernel, or "eager"
    modules: dict[str, str]       # attention module path -> its kernel, or "eager" (the model's)
    reason: str = ""              # why some or all of them stay eager
    # How the kernel splits the heads over the mesh (sharding/attention_heads.py): split, kv
    # heads repeated, or whole, and why. None when no kernel runs, or the config has no head
    # counts (then each call decides from its shapes, by the same rule).
    heads: KernelHeads | None = None

    def describe(self) -> str:
        eager = [p for p, k in self.modules.items() if k == "eager"]
        if not eager:
            return f"attention: {self.kernel} in all {len(self.modules)} attention modules"
        if len(eager) == len(self.modules):
            return (f"attention: the model's eager attention in all {len(eager)} attention "
                    f"modules ({self.reason})")
        shown = ", ".join(eager[:4]) + (f" and {len(eager) - 4} more" if len(eager) > 4 else "")
        return (f"attention: {self.kernel} in {len(self.modules) - len(eager)} of "
                f"{len(self.modules)} attention modules; the model's eager attention in {shown} "
                f"({self.reason})")


@dataclass(frozen=True)
class Plan:
    """Built once by ``build_plan`` and never changed: the steps after it read it (a model
    patched after loading gets a new Plan, kernels/attention/impl_utils.py)."""

    model_class: str
    strategy: str
    mesh: MeshShape
    dtype: str
    tensors: tuple[TensorPlan, ...] = ()
    notes: tuple[str, ...] = ()
    quantization: dict | None = None   # QuantizationConfig.to_dict() when quantized
    # (decoder layers, kv heads, head dim) of a model that generates: what its KV cache holds.
    attention: tuple[int, int, int] | None = None
    # The decoder stack of a model that generates: scanned as one loop, or why not.
    stack: StackPlan | None = None
    # "i/P" when this process stands in for host i of P (AUTOXLA_SIMULATE_HOST, tests only): it
    # loads that host's shards only and every other device holds NaN.
    simulated_host: str | None = None
    # The kernel each attention module runs, when the user asked for one (None: the model's own
    # attention throughout, unpatched).
    layer_attention: LayerAttentionPlan | None = None
    # LoRA's adapters and their placements (planning/adapters.py), when the model is planned
    # for fine-tuning (autoxla plan --lora-rank, AutoXLA.training.shard_adapters).
    adapters: AdapterPlan | None = None

    def __getitem__(self, name: str) -> TensorPlan:
        index = self._by_name()
        if name not in index:
            raise KeyError(f"{name!r} is not in the plan of {self.model_class}")
        return index[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name()

    def _by_name(self) -> dict[str, TensorPlan]:
        # The loader looks up every quantized tensor: indexed on first use (a frozen dataclass
        # still has a __dict__ for such a cache; it is no field, so neither JSON nor == sees it).
        index = self.__dict__.get("_index")
        if index is None:
            index = self.__dict__["_index"] = {t.name: t for t in self.tensors}
        return index

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    @property
    def parameters(self) -> list[TensorPlan]:
        return [t for t in self.tensors if not t.is_buffer]

    def split_by_expert(self) -> set[str]:
        """The expert tensors split by expert over fsdp (expert parallelism), with the quantized
        scales that follow them: they stay on their devices, the tokens travel to them."""
        split = {t.name for t in self.tensors if t.role == rules.EXPERTS and t.spec
                 and t.spec[0] is not None and "fsdp" in
                 ((t.spec[0],) if isinstance(t.spec[0], str) else t.spec[0])}
        return split | {t.name for t in self.tensors if t.derived_from in split}

    @property
    def replicated_for_divisibility(self) -> list[TensorPlan]:
        return [t for t in self.tensors if t.reason]

    def total_bytes(self) -> int:
        """Model bytes (tied tensors counted once)."""
        return sum(t.nbytes for t in self.tensors if not t.tied_to)

    def bytes_per_device(self) -> int:
        return sum(t.bytes_per_device for t in self.tensors if not t.tied_to)

    def _quantized_count(self) -> str:
        """"14 linear(s)", or "8 linear(s) and 4 expert projection(s)"."""
        experts = sum(1 for t in self.tensors if t.backend and t.role == rules.EXPERTS)
        linears = sum(1 for t in self.tensors if t.backend) - experts
        return f"{linears} linear(s)" + (f" and {experts} expert projection(s)" if experts else "")

    def summary(self) -> str:
        """One line: model, strategy, mesh, bytes in all and per device."""
        total, per_dev = self.total_bytes(), self.bytes_per_device()
        quant = f", {self._quantized_count()} quantized" if self.quantization else ""
        return (f"{self.model_class}: strategy {self.strategy}, mesh {self.mesh} on "
                f"{self.mesh.num_devices} devices, {self.dtype}{quant}; {total / 2**20:.1f} MiB, "
                f"{per_dev / 2**20:.1f} MiB per device, "
                f"{len(self.replicated_for_divisibility)} tensor(s) replicated for divisibility"
                + (f"; SIMULATED host {self.simulated_host} (AUTOXLA_SIMULATE_HOST): the other "
                   "hosts' devices hold NaN, outputs are not meaningful" if self.simulated_host
                   else ""))

    def kv_cache(self, batch: int, length: int, dtype=None) -> KVCachePlan:
        """The static KV cache generation allocates for ``batch`` sequences of ``length`` slots:
        its spec on this mesh and bytes per device (``.describe(plan.mesh)``)."""
        if self.attention is None:
            raise ValueError(f"{self.model_class} does not generate: it has no KV cache to plan")
        dtype = dtype or (self.dtype if self.dtype != "checkpoint" else "float32")
        return kv_cache_for(self.attention, self.mesh, dtype, batch, length)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mesh"] = dict(zip(AXES, self.mesh.sizes))
        for key in ("layer_attention", "adapters"):   # added after format 1: only when set
            if d[key] is None:
                del d[key]
        if self.adapters is not None:
            d["adapters"] = self.adapters.to_dict()
        d["format_version"] = 1
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        rows = [("tensor", "role", "shape", "dtype", "spec", "shard", "MiB/dev", "note")]
        for t in self.tensors:
            note = t.reason or (f"tied to {t.tied_to}" if t.tied_to else "")
            if t.backend:
                note = (note + "; " if note else "") + f"{t.quant} via {t.backend}"
            if t.backend == "pallas" and t.pallas_tuned:
                tuned = ", ".join(f"v{g}" for g in t.pallas_tuned)
                note += f" (tuned tiles on TPU {tuned}; other TPUs: the next backend)"
            elif t.backend == "pallas":
                note += " (no TPU generation has tuned tiles for it: the next backend on a TPU)"
            if t.is_buffer and not t.persistent:
                note = (note + "; " if note else "") + "computed, not loaded"
            rows.append((t.name, t.role, _dims(t.shape), t.dtype, t.spec_str, _dims(t.shard_shape),
                         f"{t.bytes_per_device / 2**20:.3f}", note))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = [
            f"AutoXLA plan: {self.model_class}, strategy {self.strategy}, mesh {self.mesh} "
            f"({self.mesh.num_devices} devices), dtype {self.dtype}",
        ]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        total, per_dev = self.total_bytes(), self.bytes_per_device()
        n_rep = len(self.replicated_for_divisibility)
        lines.append(
            f"total {total / 2**20:.2f} MiB in {len(self.parameters)} parameters; per device "
            f"{per_dev / 2**20:.2f} MiB ({per_dev / max(total, 1):.1%} of the model); "
            f"{n_rep} tensor(s) replicated for divisibility")
        if any(t.backend for t in self.tensors):
            lines.append(f"{self._quantized_count()} quantized; their scales and zero points "
                         "included above")
        if self.layer_attention is not None:
            lines.append(self.layer_attention.describe())
            if self.layer_attention.heads is not None:
                lines.append(self.layer_attention.heads.describe(self.mesh))
        if self.stack is not None:
            lines.append(self.stack.describe())
        if self.adapters is not None:
            lines.append(self.adapters.describe())
        if self.attention is not None:
            batch = self.mesh.size(("data", "fsdp"))    # the smallest batch that splits
            lines.append(f"generation: {self.kv_cache(batch, 2048).describe(self.mesh)} "
                         "(plan.kv_cache(batch, length) for others)")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _dims(shape) -> str:
    return "x".join(str(s) for s in shape) if shape else "scalar"


def _nbytes(shape, dtype: str) -> int:
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def build_plan(model: nn.Module, config, mesh: MeshShape, strategy: str,
               dtype: torch.dtype | None = None, tied: dict[str, str] | None = None,
               scan_layers: bool = True, quantization=None,
               layer_attention: LayerAttentionPlan | None = None, multislice=None,
               simulated_host: str | None = None) -> Plan:
    """The plan for ``model`` (usually on the meta device) on a mesh of shape ``mesh``.

    ``tied`` maps a tensor name to the name whose storage it shares (transformers' tied weights);
    a tied tensor takes its source's spec, since one buffer cannot hold two layouts.
    ``quantization``: the QuantizationReport the model's layers were quantized by
    (quantization/decisions.py; None for a float model), whose formats, backends and notes the
    plan records as they were decided, not as read back off the swapped modules.
    ``layer_attention``: the kernel each attention module will run (attention/patch.py), which
    the decoder stack is checked with before any module is patched. ``multislice``: the
    sharding.multislice.MultiSlice the mesh spans, whose links the notes name;
    ``simulated_host``: "i/P" when this process stands in for host i of P (tests).
    """
    tied = dict(tied or {})
    output_embedding = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    modules = dict(model.named_modules())
    configs = module_configs(model, config)
    persistent = persistent_buffer_names(model)
    entries: dict[str, TensorPlan] = {}
    named = [(n, p, False) for n, p in model.named_parameters(remove_duplicate=False)]
    named += [(n, b, True) for n, b in model.named_buffers(remove_duplicate=False)]
    for name, tensor, is_buffer in named:
        owner_path = name.rsplit(".", 1)[0] if "." in name else ""
        owner = modules[owner_path] if owner_path else model
        rule = rules.classify(name, tensor, owner, output_embedding, configs[owner_path], is_buffer)
        shape = tuple(tensor.shape)
        spec, reasons = rules.resolve_spec(rule, shape, mesh)
        # Buffers keep the dtype their module built them in (rotary inv_freq stays fp32 in a bf16
        # model, as in transformers); floating parameters take the load dtype.
        floating = tensor.is_floating_point() and not is_buffer
        tdtype = dtype if (dtype is not None and floating) else tensor.dtype
        entries[name] = _entry(name, rule.role, shape, dtype_name(tdtype), spec, mesh,
                               "; ".join(reasons), is_buffer, persistent=name in persistent or not is_buffer,
                               **_quant_fields(name, quantization))
    for target, source in tied.items():
        if target in entries and source in entries:
            src = entries[source]
            t = entries[target]
            entries[target] = _entry(target, t.role, t.shape, src.dtype, src.spec, mesh, src.reason,
                                     t.is_buffer, tied_to=source)
    report = quantization
    attention = _attention(model, config)
    notes = report.notes() if report is not None else []
    notes += _experts_notes(list(entries.values()), mesh)
    if multislice is not None:
        notes.append("links: " + multislice.links(mesh))
    return Plan(model_class=type(model).__name__, strategy=strategy, mesh=mesh,
                dtype=dtype_name(dtype) if dtype is not None else "checkpoint",
                tensors=tuple(entries.values()),
                notes=tuple(notes),
                quantization=report.config.to_dict() if report is not None else None,
                attention=attention,
                stack=plan_stack(model, scan_layers, layer_attention and layer_attention.modules)
                if attention is not None else None,
                layer_attention=layer_attention, simulated_host=simulated_host)


def _experts_notes(tensors: list[TensorPlan], mesh: MeshShape) -> list[str]:
    """What expert parallelism does on this mesh, for a model with experts (sharding/rules.py)."""
    experts = [t for t in tensors if t.role == rules.EXPERTS and len(t.shape) == 3]
    if not experts:
        return []
    count = experts[0].shape[0]
    split = [t for t in experts if t.spec[0] is not None]
    per_device = experts[0].shard_shape[0]
    share = sum(t.bytes_per_device for t in experts)
    line = (f"experts: {len(experts)} expert tensors of {count} experts; each device holds "
            f"{per_device} expert(s) of every layer ({share / 2**20:.2f} MiB); ")
    if mesh.fsdp > 1 and split:
        line += (f"split by expert over fsdp={mesh.fsdp} (expert parallelism: tokens meet their "
                 "experts across that axis, which also splits the batch)")
    elif mesh.fsdp > 1:
        line += (f"not split by expert: {count} experts do not divide fsdp={mesh.fsdp}, so each "
                 "expert's intermediate dim is split over fsdp instead (as FSDP would)")
    else:
        line += "not split by expert: this mesh has no fsdp axis (strategy dp or mp)"
    if mesh.model > 1:
        line += f"; the hidden dim over model={mesh.model}"
    return [line]


def _attention(model: nn.Module, config):
    if config is None or not (hasattr(model, "can_generate") and model.can_generate()):
        return None
    try:
        return attention_shape(config)
    except (ValueError, AttributeError, TypeError):
        return None


def _entry(name, role, shape, dtype, spec, mesh, reason, is_buffer, tied_to="", persistent=True,
           **quant):
    shard = tuple(s // mesh.size(a) for s, a in zip(shape, spec))
    return TensorPlan(name=name, role=role, shape=shape, dtype=dtype, spec=spec, shard_shape=shard,
                      bytes_per_device=_nbytes(shard, dtype), reason=reason, is_buffer=is_buffer,
                      tied_to=tied_to, persistent=persistent, **quant)


def _quant_fields(name: str, report) -> dict:
    """A quantized tensor's entries from its layer's decision (LayerDecision, keyed by the
    module's name): format, backend, the float weight it is made from."""
    prefix, _, leaf = name.rpartition(".")
    decision = report.layers.get(prefix) if report is not None else None
    if decision is None:
        return {}
    fmt = decision.fmt
    if leaf == "weight":
        fields = dict(quant=fmt.label, backend=decision.backend,
                      source_shape=(fmt.out_features, fmt.in_features),
                      pallas_tuned=tuple(decision.pallas_tuned))
        if decision.experts:   # QuantizedExperts: made from the float [experts, ...] parameter
            fields.update(source_shape=tuple(decision.source_shape), source_name=prefix)
        elif decision.transposed:   # a Conv1D's weight, stored (in, out)
            fields.update(source_shape=tuple(decision.source_shape))
        return fields
    if leaf in rules.QUANT_SIDECARS:
        return dict(quant=fmt.label, derived_from=f"{prefix}.weight" if prefix else "weight")
    return {}


def persistent_buffer_names(model: nn.Module) -> set[str]:
    """Buffers a checkpoint holds (state_dict keeps them); the others are computed in __init__."""
    names = set()
    for mod_name, mod in model.named_modules():
        for b in mod._buffers:
            if b not in mod._non_persistent_buffers_set:
                names.add(f"{mod_name}.{b}" if mod_name else b)
    return names
