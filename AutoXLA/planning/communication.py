"""Communication per step, forecast from a Plan alone: which collectives a training step or a
decode step needs on the plan's mesh, per decoder layer and in total.

Bytes are per device: an op's *payload* is the buffer one device holds for it (an all-gather's
gathered result, a reduce-scatter's unreduced input, an all-reduce's buffer), which is what the
partitioned HLO shows (evaluation/measure.py compiles it, planning/hlo.py reads it back). *Wire*
bytes add the ring algorithm's factor, the data each device sends: (n-1)/n of the payload for an
all-gather or reduce-scatter over n devices, 2(n-1)/n for an all-reduce (a reduce-scatter then an
all-gather).

The rules (docs/planning.md, "Communication per step"):
- a weight split over fsdp is all-gathered over fsdp before its forward use, and again in
  backward (the gathered copy is not kept: that is what FSDP saves);
- every gradient is reduced over the axes the batch is split on (data x fsdp): reduce-scattered
  (over data x fsdp, to the fsdp shard) when the weight is split over fsdp, else all-reduced;
- a row-parallel linear split on model sums partial products: one all-reduce of its output
  [tokens, out] per forward; a column-parallel linear's input gradient is partial: one
  all-reduce of [tokens, in] per backward and linear (Megatron sums q/k/v's and gate/up's first,
  2 per layer; XLA all-reduces each, 5 per layer: measured);
- an embedding split by vocabulary looks up locally and all-reduces [tokens, hidden], the token
  ids first gathered over the batch axes that also split the vocabulary (what XLA's partitioner
  does for a gather from a split table);
- experts split by expert over fsdp (expert parallelism) are never gathered: the tokens are,
  all-gathered over fsdp into each MoE layer and its combined output reduce-scattered back
  (the reverse in backward); their gradients need only the data axis. Experts that do not divide
  fsdp are split like FSDP and follow its rules;
- quantized weights and their scales (buffers, never trained) are gathered as weights are,
  with no gradient; quantized experts split by expert stay with their experts;
- the loss: its mean over the split batch, one scalar all-reduce (in train mode; measured);
  over a vocabulary split on model, 3 all-reduces of [tokens] (max, sum of exp, the label's
  logit); a decode step gathers the logits [batch, vocab] over model to pick the next token.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

from ..sharding import rules

_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1,
            "int32": 4, "int64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
_HLO_DTYPE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
              "int8": "s8", "uint8": "u8", "int32": "s32", "int64": "s64", "uint32": "u32"}
_LAYER = re.compile(r"\.layers\.(\d+)\.")
BATCH_AXES = ("data", "fsdp")


@dataclass(frozen=True)
class CommOp:
    kind: str                  # all-gather | reduce-scatter | all-reduce
    what: str                  # e.g. "weight model.layers.0.mlp.up_proj.weight"
    phase: str                 # forward | backward | gradient
    dtype: str                 # torch dtype name
    shape: tuple[int, ...]     # payload per device
    axes: tuple[str, ...]      # mesh axes the op runs over
    group_size: int
    layer: int | None = None   # decoder layer index, None outside the layers
    count: int = 1

    @property
    def payload_bytes(self) -> int:
        return self.count * math.prod(self.shape) * _ELEMENT.get(self.dtype, 4)

    @property
    def wire_bytes(self) -> float:
        n = self.group_size
        ring = 2 * (n - 1) / n if self.kind == "all-reduce" else (n - 1) / n
        return self.payload_bytes * ring

    @property
    def shape_str(self) -> str:
        return f"{_HLO_DTYPE.get(self.dtype, self.dtype)}[{','.join(map(str, self.shape))}]"


@dataclass
class CommReport:
    strategy: str
    mesh: object
    train: bool
    batch: int
    seq: int
    ops: list[CommOp] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def per_layer(self) -> dict:
        """layer (None = outside the decoder layers) -> its ops."""
        out = defaultdict(list)
        for op in self.ops:
            out[op.layer].append(op)
        return dict(out)

    def totals(self) -> dict[str, tuple[int, int, float]]:
        """kind -> (number of ops, payload bytes, wire bytes) per device per step."""
        t = defaultdict(lambda: [0, 0, 0.0])
        for op in self.ops:
            r = t[op.kind]
            r[0] += op.count
            r[1] += op.payload_bytes
            r[2] += op.wire_bytes
        return {k: tuple(v) for k, v in t.items()}

    def describe(self) -> str:
        step = (f"training step (forward + backward + gradient sync), batch {self.batch} x seq "
                f"{self.seq}" if self.train else f"decode step, batch {self.batch}")
        lines = [f"communication per {step}, strategy {self.strategy}, mesh {self.mesh}; bytes "
                 "per device (payload = the buffer each device holds; wire = payload x ring "
                 "factor (n-1)/n, 2(n-1)/n for all-reduce)"]
        layers = self.per_layer()
        rows = [("where", "op", "phase", "over", "ops", "payload MiB", "wire MiB")]
        for layer in sorted(layers, key=lambda x: -1 if x is None else x):
            grouped = defaultdict(lambda: [0, 0, 0.0])
            for op in layers[layer]:
                g = grouped[(op.kind, op.phase, "x".join(op.axes))]
                g[0] += op.count
                g[1] += op.payload_bytes
                g[2] += op.wire_bytes
            where = "outside layers" if layer is None else f"layer {layer}"
            for (kind, phase, axes), (n, pay, wire) in grouped.items():
                rows.append((where, kind, phase, axes, str(n), f"{pay / 2**20:.3f}",
                             f"{wire / 2**20:.3f}"))
        for kind, (n, pay, wire) in self.totals().items():
            rows.append(("total", kind, "", "", str(n), f"{pay / 2**20:.3f}", f"{wire / 2**20:.3f}"))
        n, pay, wire = (sum(v[i] for v in self.totals().values()) for i in range(3))
        rows.append(("total", "all", "", "", str(n), f"{pay / 2**20:.3f}", f"{wire / 2**20:.3f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def communication(plan, *, batch: int, seq: int = 1, train: bool = True) -> CommReport:
    """The collectives of one step of ``plan``'s model: a training step over ``batch`` sequences
    of ``seq`` tokens, or (``train=False``) a decode step of one token for ``batch`` sequences."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    mesh = plan.mesh
    report = CommReport(plan.strategy, mesh, train, batch, seq if train else 1)
    tokens = _local_tokens(mesh, batch, seq if train else 1, report.notes)
    act = _activation_dtype(plan)
    dsize = mesh.size(BATCH_AXES)
    add = report.ops.append
    # The weights: parameters, and the quantized tensors (buffers, read but never trained).
    params = [t for t in plan.tensors if not t.tied_to and (not t.is_buffer or t.quant)]
    by_expert = plan.split_by_expert()
    for t in params:
        layer = _layer(t.name)
        fsdp_dim = _dim_on(t, "fsdp") if mesh.fsdp > 1 else None
        gathered = _restore(t.shard_shape, fsdp_dim, mesh.fsdp)
        trained = not t.is_buffer
        if t.name in by_expert:   # tokens move instead
            if not t.derived_from:    # the weight, not its scales
                _expert_parallel(t, mesh, tokens, act, train, layer, add, _hidden(params))
            if train and trained and mesh.data > 1:
                add(CommOp("all-reduce", f"gradient {t.name}", "gradient", t.dtype, t.shard_shape,
                           ("data",), mesh.data, layer))
            continue
        if t.role == rules.EMBEDDING:
            _embedding(t, mesh, tokens, act, layer, add)
        elif fsdp_dim is not None:
            for phase in ("forward", "backward") if train else ("forward",):
                add(CommOp("all-gather", f"weight {t.name}", phase, t.dtype, gathered, ("fsdp",),
                           mesh.fsdp, layer))
        if train and trained and dsize > 1:
            if fsdp_dim is not None:
                # With data > 1 too, XLA reduces over data x fsdp in one op (measured on 3d)
                # rather than a reduce-scatter over fsdp then an all-reduce over data.
                axes = BATCH_AXES if mesh.data > 1 else ("fsdp",)
                add(CommOp("reduce-scatter", f"gradient {t.name}", "gradient", t.dtype, gathered,
                           axes, mesh.size(axes), layer))
            else:
                add(CommOp("all-reduce", f"gradient {t.name}", "gradient", t.dtype, t.shard_shape,
                           BATCH_AXES, dsize, layer))
    if mesh.model > 1:
        _tensor_parallel(params, mesh, tokens, act, train, add)
    if train and dsize > 1:
        add(CommOp("all-reduce", "loss: the mean over the batch", "forward", "float32", (),
                   BATCH_AXES, dsize, None))
    return report


def _expert_parallel(t, mesh, tokens, act, train, layer, add, hidden: int):
    """Once per MoE layer (at its gate/up experts): the layer's tokens [tokens, hidden] gathered
    over fsdp to meet the experts each device holds, their weighted outputs summed back to each
    device's tokens; backward does the same to the output's and the input's gradients. The
    hidden dim is split over model as the activations are."""
    if not t.name.removesuffix(".weight").endswith(("gate_up_proj", ".up_proj")):
        return
    payload = (tokens * mesh.fsdp, hidden // mesh.model if hidden % mesh.model == 0 else hidden)
    add(CommOp("all-gather", f"tokens to the experts of {t.name}", "forward", act, payload,
               ("fsdp",), mesh.fsdp, layer))
    add(CommOp("reduce-scatter", f"expert outputs of {t.name}", "forward", act, payload,
               ("fsdp",), mesh.fsdp, layer))
    if train:
        add(CommOp("all-gather", f"output gradient to the experts of {t.name}", "backward", act,
                   payload, ("fsdp",), mesh.fsdp, layer))
        add(CommOp("reduce-scatter", f"input gradient from the experts of {t.name}", "backward",
                   act, payload, ("fsdp",), mesh.fsdp, layer))


def _tensor_parallel(params, mesh, tokens, act, train, add):
    """Megatron's activation all-reduces over model: after each row-parallel linear forward,
    and once per module of column-parallel linears backward (their shared input's gradient)."""
    columns = []
    for t in params:
        if not t.name.endswith(".weight") or len(t.shape) != 2:
            continue
        if t.role == rules.ROW and _dim_on(t, "model") == 1:
            add(CommOp("all-reduce", f"activation after {t.name}", "forward", act,
                       (tokens, t.shape[0]), ("model",), mesh.model, _layer(t.name)))
        elif t.role in (rules.COLUMN, rules.LM_HEAD) and _dim_on(t, "model") == 0:
            columns.append(t)
        if t.role == rules.LM_HEAD and _dim_on(t, "model") == 0:
            if train:   # cross-entropy over a vocabulary split on model: max, sum of exp, label
                add(CommOp("all-reduce", "loss over the split vocabulary", "forward", "float32",
                           (tokens,), ("model",), mesh.model, None, 3))
            else:       # the next token is chosen from whole logits
                add(CommOp("all-gather", "logits for sampling", "forward", act,
                           (tokens, t.shape[0]), ("model",), mesh.model, None))
    if train:
        # One per linear: XLA all-reduces each one's partial input gradient before summing them
        # (measured: q, k, v and gate, up are 5 all-reduces per layer, not Megatron's 2).
        for t in columns:
            add(CommOp("all-reduce", f"input gradient of {t.name}", "backward", act,
                       (tokens, t.shape[1]), ("model",), mesh.model, _layer(t.name)))


def _embedding(t, mesh, tokens, act, layer, add):
    """A table split by vocabulary: local lookup, all-reduce of [tokens, hidden-shard]; the ids
    are gathered first over batch axes that also split the table."""
    axes = _axes_of(t.spec[0])
    if not axes or mesh.size(axes) == 1:
        return
    shared = tuple(a for a in axes if a in BATCH_AXES)
    n_tokens = tokens * mesh.size(shared)
    if mesh.size(shared) > 1:
        add(CommOp("all-gather", f"token ids for {t.name}", "forward", "uint32", (n_tokens,),
                   shared, mesh.size(shared), layer))
    add(CommOp("all-reduce", f"lookup in {t.name}", "forward", act, (n_tokens, t.shard_shape[1]),
               axes, mesh.size(axes), layer))


def _hidden(params) -> int:
    """The model's hidden size: its input embedding's width."""
    return next(t.shape[1] for t in params if t.role == rules.EMBEDDING)


def _local_tokens(mesh, batch, seq, notes) -> int:
    split = mesh.size(BATCH_AXES)
    if batch % split:
        notes.append(f"batch {batch} does not divide data x fsdp = {split}: counted replicated")
        return batch * seq
    return batch // split * seq


def _activation_dtype(plan) -> str:
    if plan.dtype != "checkpoint":
        return plan.dtype
    floats = [t.dtype for t in plan.parameters if t.dtype.startswith(("float", "bfloat"))]
    return floats[0] if floats else "float32"


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _dim_on(t, axis: str) -> int | None:
    for i, entry in enumerate(t.spec):
        if axis in _axes_of(entry):
            return i
    return None


def _restore(shard_shape, dim, n) -> tuple[int, ...]:
    if dim is None:
        return tuple(shard_shape)
    return tuple(s * n if i == dim else s for i, s in enumerate(shard_shape))


def _layer(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None
