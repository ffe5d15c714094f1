"""Per-device memory of training and inference, from a Plan and the model's config alone.

Every line carries the formula it was computed by (docs/planning.md, "Memory forecast"). Counted:
the tensors a program keeps alive by design (weights, gradients, optimizer states, what autograd
saves for the backward, the KV cache, logits). Not counted: XLA's temporaries inside a fused
layer, its buffer reuse and fragmentation, the runtime's own reservations: the headroom is for those.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..sharding import rules
from ..sharding.configs import decoder_config

OPTIMIZERS = ("adamw", "sgd", "sgdm", "lion", "came", "sm3")
_FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# Layer types whose attention normalises q and k per head (an RMSNorm over head_dim each).
_QK_NORM = frozenset({"qwen3", "qwen3_moe", "olmo2", "gemma3", "gemma3_text"})


@dataclass(frozen=True)
class TrainingSetup:
    """One training step: ``batch`` sequences of ``seq`` tokens, the optimizer, checkpointing."""

    batch: int
    seq: int
    optimizer: str = "adamw"
    grad_ckpt: bool = False

    def __post_init__(self):
        _positive("batch", self.batch, "--batch")
        _positive("seq", self.seq, "--seq")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of "
                             f"{', '.join(OPTIMIZERS)} (sgdm: SGD with momentum)")


@dataclass(frozen=True)
class InferenceSetup:
    """Generation: ``batch`` sequences in a static KV cache of ``max_len`` slots."""

    batch: int
    max_len: int

    def __post_init__(self):
        _positive("batch", self.batch, "--batch")
        _positive("max_len", self.max_len, "--max-len")


def _positive(name, value, flag):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive whole number, got {value!r}: pass {flag} N")


@dataclass(frozen=True)
class Line:
    name: str
    bytes_per_device: int
    formula: str


@dataclass
class Forecast:
    """Lines of per-device bytes; ``capacity`` (bytes per device) once a topology is known."""

    mode: str                     # "train" | "infer"
    lines: list[Line]
    capacity: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(line.bytes_per_device for line in self.lines)

    @property
    def headroom(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.total

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.total <= self.capacity

    def to_dict(self) -> dict:
        return {"mode": self.mode, "total_bytes_per_device": self.total,
                "capacity_bytes_per_device": self.capacity, "headroom_bytes": self.headroom,
                "fits": self.fits, "notes": list(self.notes),
                "lines": [dict(name=x.name, bytes_per_device=x.bytes_per_device, formula=x.formula)
                          for x in self.lines]}

    def describe(self) -> str:
        width = max(len(x.name) for x in self.lines)
        out = [f"memory forecast per device ({self.mode}):"]
        out += [f"  {x.name.ljust(width)}  {_gib(x.bytes_per_device):>10}  {x.formula}"
                for x in self.lines]
        total = f"  {'total'.ljust(width)}  {_gib(self.total):>10}"
        if self.capacity is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            total += (f"  of {_gib(self.capacity)} per device: {verdict}, headroom "
                      f"{_gib(self.headroom)} ({self.headroom / self.capacity:.0%})")
        out.append(total)
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


# --- parameters, gradients, optimizer states -------------------------------------------------

def _trainable(plan):
    """Floating parameters stored once (a tied weight shares its source's storage and gradient)."""
    return [t for t in plan.parameters if not t.tied_to and t.dtype in _FLOAT_BYTES]


def optimizer_state_bytes(optimizer: str, shape: tuple, dtype: str) -> int:
    """Bytes of the state ``optimizer`` allocates for one parameter of ``shape`` (whole, or one
    device's shard: the states are sharded like their parameter, dim by dim)."""
    e, n = _FLOAT_BYTES[dtype], math.prod(shape)
    if optimizer == "adamw":        # torch.optim.AdamW: exp_avg, exp_avg_sq like p, step fp32 ()
        return 2 * n * e + 4
    if optimizer == "sgd":          # torch.optim.SGD, momentum=0: no state
        return 0
    if optimizer in ("sgdm", "lion"):   # momentum_buffer / exp_avg like p
        return n * e
    if optimizer == "came":
        # pytorch_optimizer 4.1 CAME: exp_avg like p; rank >= 2: row (shape[:-1]) and column
        # (shape[:-2] + shape[-1:]) averages of the squared gradient and of the residual;
        # vectors: a full exp_avg_sq; and the parameter's RMS, a scalar in its dtype.
        if len(shape) >= 2:
            return n * e + 2 * (math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:])) * e + e
        return 2 * n * e + e
    if optimizer == "sm3":
        # pytorch_optimizer 4.1 SM3: momentum_buffer like p (allocated even at momentum=0) and one
        # accumulator per dim (shape[i] entries); a scalar's accumulator is the scalar.
        return n * e + (sum(shape) if shape else 1) * e
    raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")


_STATE_FORMULA = {
    "adamw": "2 x params (exp_avg, exp_avg_sq in the param dtype) + 4 B step per tensor",
    "sgd": "0 (no momentum; sgdm keeps 1 x params)",
    "sgdm": "1 x params (momentum_buffer)",
    "lion": "1 x params (exp_avg)",
    "came": "exp_avg (1 x params) + 2 x (rows + cols) per matrix, vectors 2 x params; RMS scalar",
    "sm3": "momentum_buffer (1 x params) + sum(shape) per tensor (one accumulator per dim)",
}


# --- weights gathered by FSDP ---------------------------------------------------------------

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _uses(spec: tuple, axis: str) -> bool:
    return any(a == axis or (isinstance(a, tuple) and axis in a) for a in spec)


def gathered_weights(plan, train: bool) -> Line | None:
    """Weights split over fsdp are gathered whole on fsdp before their matmul (still split over
    model), and the copies are temporaries the plan's bytes do not count. The token embedding
    is looked up in place, never gathered (measured: docs/planning.md).

    Alive at once: a scanned stack's loop gathers one layer per iteration, so the largest group
    (a decoder layer, or a tensor outside the stack such as lm_head); an unrolled stack lets XLA
    schedule every gather early, so all of them (what XLA:CPU did, measured), and so do the
    unrolled layers in front of a loop (``plan.stack.start``). Training adds the
    largest group's gradient at its gathered size, alive until its reduce-scatter. Experts split
    by expert are never gathered (the tokens travel to them, docs/models.md)."""
    fsdp = plan.mesh.fsdp
    if fsdp == 1:
        return None
    groups: dict[str, int] = {}
    by_expert = plan.split_by_expert()
    for t in plan.tensors:
        weight = not t.is_buffer or t.quant          # quantized weights and scales are buffers
        if t.tied_to or not weight or t.role == rules.EMBEDDING or not _uses(t.spec, "fsdp"):
            continue
        if t.name in by_expert:   # split by expert: stays
            continue
        m = _LAYER.search(t.name)
        key = f"layer {m.group(1)}" if m else t.name
        groups[key] = groups.get(key, 0) + t.bytes_per_device * fsdp
    if not groups:
        return None
    largest = max(groups.values())
    scanned = plan.stack is not None and plan.stack.scanned
    alive = sum(groups.values())
    if scanned:
        prefix = {f"layer {i}" for i in range(plan.stack.start)}
        alive = (sum(v for k, v in groups.items() if k in prefix)
                 + max((v for k, v in groups.items() if k not in prefix), default=0))
    why = ("scanned: one layer's (or lm_head's) weights gathered over fsdp" if scanned else
           "unrolled: every fsdp-split weight gathered (XLA may schedule all gathers early)")
    if scanned and plan.stack.start:
        why += f", and all of the {plan.stack.start} unrolled layer(s) before the loop"
    if train:
        alive += largest
        why += " + the largest group's gradient before its reduce-scatter"
    return Line("gathered weights", alive, why)


# --- activations ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerShape:
    """What a decoder layer's activations depend on, read from the (text) config."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts_per_token: int = 1
    qk_norm: bool = False
    experts: int = 0              # routed experts of a mixture-of-experts layer (0: a dense MLP)
    expert_intermediate: int = 0  # one expert's intermediate size

    def mlp_width(self, model: int = 1) -> float:
        """Intermediate values per token of one layer's MLP on a device. A mixture of experts
        runs every expert on every token (moe.py, dense dispatch): all of them count,
        whatever top-k the router picks; a dense MLP splits its intermediate over model."""
        if self.experts:
            return self.experts * self.expert_intermediate
        return self.intermediate / (model if self.intermediate % model == 0 else 1)

    @classmethod
    def from_config(cls, config) -> LayerShape:
        c = decoder_config(config)
        heads = getattr(c, "num_attention_heads", None)
        need = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
        missing = [f for f in need if not getattr(c, f, None)]
        if missing:
            raise ValueError(f"{type(c).__name__} has no {', '.join(missing)}: AutoXLA forecasts "
                             "activations of decoder language models only")
        experts = next((getattr(c, f) for f in ("num_local_experts", "num_experts",
                                                 "n_routed_experts") if getattr(c, f, None)), 0)
        return cls(hidden=c.hidden_size, intermediate=c.intermediate_size, heads=heads,
                   experts=experts,
                   expert_intermediate=getattr(c, "moe_intermediate_size", None) or c.intermediate_size,
                   kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   vocab=c.vocab_size, experts_per_token=getattr(c, "num_experts_per_tok", None) or 1,
                   qk_norm=getattr(c, "model_type", "") in _QK_NORM)


def layer_saved_bytes_per_token(s: LayerShape, e: int, model: int = 1) -> float:
    """Bytes one decoder layer saves for its backward per token (docs/planning.md): two RMSNorms
    (an fp32 copy of the input, the fp32 rsqrt, the normalised and scaled outputs), q, k, v and
    their rotary halves, the attention's fp32 log-sum-exp, the gated MLP's four intermediates;
    head and intermediate terms split over the model axis where they divide."""
    q = s.heads * s.head_dim / (model if s.heads % model == 0 else 1)
    kv = s.kv_heads * s.head_dim / (model if s.kv_heads % model == 0 else 1)
    nq = s.heads / (model if s.heads % model == 0 else 1)
    inter = s.mlp_width(model)
    norms = 2 * (4 * s.hidden + 4 + 2 * e * s.hidden)
    attention = e * (2 * q + 2 * kv) + 4 * nq
    if s.qk_norm:     # fp32 copy, rsqrt and normalised q and k per head
        attention += (4 + e) * (q + kv) + 4 * (q + kv) / s.head_dim
    return norms + attention + 4 * e * inter


def lora_saved_bytes_per_token(shape: LayerShape, adapters, act_dtype: str, layers: int,
                               model: int = 1) -> float:
    """How much LoRA changes one layer's saved tensors per token (layer_saved_bytes_per_token
    counts full training's). Added: each wrapped projection's A output (r values, kept for B's
    gradient) and, when the activations are not in the adapters' dtype, its input cast to theirs
    (kept for A's gradient: one copy per projection, as peft casts in eager; XLA may merge q, k
    and v's). Removed, the base being frozen: each norm's normalised output (only its weight's
    gradient needed it) and, when A keeps a cast copy instead, the projections' own inputs (the
    norms' scaled outputs, the attention output, the MLP's product). Matches what autograd saves
    on a Llama layer exactly in fp32 and within 4 % in bf16 (tests/finetuning/test_forecast.py)."""
    e, size = _FLOAT_BYTES[act_dtype], _FLOAT_BYTES[adapters.dtype]
    cast = act_dtype != adapters.dtype
    added = 0.0
    for t in adapters.tensors:      # a head's adapter saves once, not per layer: left out
        if t.name.endswith(".lora_A.weight") and ".layers." in t.name:
            r, width = t.shape
            added += r * size
            if cast:
                added += width / (model if _uses(t.spec[1:], "model") else 1) * size
    removed = 2 * e * shape.hidden
    if cast:
        q = shape.heads * shape.head_dim / (model if shape.heads % model == 0 else 1)
        removed += e * (2 * shape.hidden + q + shape.mlp_width(model))
    return added / layers - removed


def _batch_shards(plan, batch: int) -> int:
    return plan.mesh.size(rules.batch_axes(plan.mesh, batch))


def _note_unsplit_batch(f, plan, batch, shards):
    want = plan.mesh.size(("data", "fsdp"))
    if shards == 1 and want > 1:
        f.notes.append(f"batch {batch} does not divide data*fsdp = {want}: every device holds "
                       f"the whole batch's activations; a multiple of {want} splits them")


def _note_experts(f, shape: LayerShape) -> None:
    if shape.experts:
        f.notes.append(
            f"mixture of experts: every token runs through all {shape.experts} experts (static "
            f"shapes, docs/models.md), so activations count {shape.experts} x "
            f"{shape.expert_intermediate} intermediate values per token, "
            f"{shape.experts / shape.experts_per_token:.0f}x what its top-{shape.experts_per_token} "
            "routing would need")


def _act_dtype(plan) -> tuple[str, int]:
    dtype = plan.dtype if plan.dtype in _FLOAT_BYTES else "float32"
    return dtype, _FLOAT_BYTES[dtype]


def dequantized_weights(plan, layers_kept: int | None = None) -> Line | None:
    """The float weight of every quantized linear a training step keeps from its forward to its
    backward (its input gradient needs it), in fp32 as measured on XLA:CPU, split as the codes
    are. Unrolled without checkpointing (``layers_kept`` None): every layer's, all live at the
    step's peak (the 16-layer int4 Llama of docs/finetuning.md: 109 such buffers), which an XLA
    optimization barrier did not free. A scanned or checkpointed stack recomputes a layer at a
    time: ``layers_kept`` layers' worth (one, and any unrolled layers before the loop; measured
    in the same model's scanned step: one layer's seven projections in fp32, 193 MiB, live at
    its peak)."""
    total = 0
    for t in plan.tensors:
        if t.backend and t.role != rules.EXPERTS and not t.tied_to:
            pieces = math.prod(t.shape) // max(math.prod(t.shard_shape), 1)
            total += math.prod(t.source_shape) * 4 // max(pieces, 1)
    if not total:
        return None
    if layers_kept is None:
        return Line("dequantized weights", total, "unrolled, no checkpointing: every quantized "
                    "linear's weight dequantized in fp32 for the backward, split like its codes "
                    "(measured on XLA:CPU; docs/finetuning.md)")
    layers = plan.attention[0]
    kept = min(layers_kept, layers)
    return Line("dequantized weights", total * kept // layers,
                f"{kept} layer(s) at a time: a recomputed layer's quantized linears dequantized "
                "in fp32 for its backward, split like their codes (measured on XLA:CPU; "
                "docs/finetuning.md)")


def training_forecast(plan, config, setup: TrainingSetup) -> Forecast:
    """Parameters, gradients, optimizer states, activations saved for the backward and logits of
    one training step, per device. With LoRA (``plan.adapters``) the base is frozen: only the
    adapters have gradients and optimizer states."""
    adapters = plan.adapters
    p_bytes = sum(t.bytes_per_device for t in plan.tensors if not t.tied_to)
    if adapters is None:
        params = _trainable(plan)
        g_bytes = sum(t.bytes_per_device for t in params)
        s_bytes = sum(optimizer_state_bytes(setup.optimizer, t.shard_shape, t.dtype)
                      for t in params)
        lines = [Line("parameters", p_bytes, "sum of the plan's bytes per device (exact)"),
                 Line("gradients", g_bytes, "1 x trainable params, sharded and typed like them"),
                 Line(f"optimizer ({setup.optimizer})", s_bytes, _STATE_FORMULA[setup.optimizer])]
    else:
        a_bytes = adapters.bytes_per_device()
        s_bytes = sum(optimizer_state_bytes(setup.optimizer, t.shard_shape, adapters.dtype)
                      for t in adapters.tensors)
        lines = [Line("frozen base", p_bytes, "sum of the plan's bytes per device (exact): no "
                      "gradients, no optimizer state"),
                 Line("adapters", a_bytes, f"LoRA r={adapters.rank} A and B in {adapters.dtype}, "
                      "placed like their base layer (exact)"),
                 Line("gradients", a_bytes, "1 x adapters"),
                 Line(f"optimizer ({setup.optimizer})", s_bytes,
                      _STATE_FORMULA[setup.optimizer] + ", of the adapters")]
    # a frozen base has no weight gradients waiting for their reduce-scatter
    lines += [x for x in (gathered_weights(plan, train=adapters is None),) if x is not None]
    f = Forecast("train", lines)
    if plan.mesh.model > 1 and adapters is None:
        f.notes.append("gradients are forecast sharded like their parameters; on a mesh with a "
                       "model axis AutoXLA leaves their layout to XLA, which kept some whole on "
                       "every device when measured (2d: 8x the sharded bytes on a tiny Llama; "
                       "docs/planning.md, 'Gradients'): allow for it in the headroom")
    if plan.attention is None:
        f.notes.append(f"{plan.model_class} is not a decoder LM: activations and logits are not "
                       "forecast (only its parameters, gradients and optimizer states)")
        return f
    shape = LayerShape.from_config(config)
    _note_experts(f, shape)
    dtype, e = _act_dtype(plan)
    layers = plan.attention[0]
    shards = _batch_shards(plan, setup.batch)
    tokens = setup.batch * setup.seq / shards          # tokens per device
    _note_unsplit_batch(f, plan, setup.batch, shards)
    per_layer = layer_saved_bytes_per_token(shape, e, plan.mesh.model)
    if adapters is not None:
        per_layer += lora_saved_bytes_per_token(shape, adapters, dtype, layers, plan.mesh.model)
    scanned = plan.stack is not None and plan.stack.scanned
    b_s = f"B*S/{shards}" if shards > 1 else "B*S"
    if scanned or setup.grad_ckpt:
        # Checkpointed layer by layer (a scanned stack always is, docs/scan.md): each layer's
        # input is kept, one layer's saved tensors are alive while it is recomputed.
        act = layers * tokens * e * shape.hidden + tokens * per_layer
        why = "scanned stack: checkpointed per layer" if scanned else "--grad-ckpt"
        formula = (f"{why}: L*{b_s}*hidden*{e} + {b_s}*A, A = {per_layer:.0f} B/token "
                   "saved by one layer")
        start = plan.stack.start if scanned and not setup.grad_ckpt else 0
        if start:     # the unrolled layers before the loop keep all they save
            act += start * tokens * per_layer
            formula += f" + {start} unrolled layer(s)*{b_s}*A"
        dequantized = dequantized_weights(plan, layers_kept=1 + start)
    else:
        act = layers * tokens * per_layer
        formula = f"unrolled, no checkpointing: L*{b_s}*A, A = {per_layer:.0f} B/token per layer"
        dequantized = dequantized_weights(plan)
    if dequantized is not None:
        lines.append(dequantized)
    if adapters is not None:
        formula += (" (LoRA: the frozen base's weight-gradient inputs out; A's output for B's "
                    f"gradient and, where the model's dtype differs, A's input in "
                    f"{adapters.dtype} in)")
    lines.append(Line("activations", int(act), formula))
    vocab_split = plan.mesh.model if shape.vocab % plan.mesh.model == 0 else 1
    logits = tokens * shape.vocab / vocab_split * (e + 4 + 4)
    lines.append(Line("logits", int(logits), f"{b_s}*vocab/{vocab_split}*({e}+4+4): logits in "
                      f"{dtype}, their fp32 log-softmax and its gradient"))
    return f


def inference_forecast(plan, config, setup: InferenceSetup) -> Forecast:
    """Weights, the KV cache, the larger of prefill's and decode's live activations, logits."""
    kv = plan.kv_cache(setup.batch, setup.max_len)
    lines = [Line("weights", plan.bytes_per_device(),
                  "sum of the plan's bytes per device (exact; quantized tensors as planned)"),
             Line("KV cache", kv.bytes_per_device(plan.mesh),
                  f"2*L*B*kv_heads*max_len*head_dim*bytes, spec {kv.spec} (exact)")]
    lines += [x for x in (gathered_weights(plan, train=False),) if x is not None]
    shape = LayerShape.from_config(config)
    dtype, e = _act_dtype(plan)
    shards, m = _batch_shards(plan, setup.batch), plan.mesh.model
    f = Forecast("infer", lines)
    _note_unsplit_batch(f, plan, setup.batch, shards)
    _note_experts(f, shape)

    def live(tokens):   # one layer at a time (no autograd): residual + normed + the larger part
        q = shape.heads * shape.head_dim / (m if shape.heads % m == 0 else 1)
        kvd = shape.kv_heads * shape.head_dim / (m if shape.kv_heads % m == 0 else 1)
        inter = shape.mlp_width(m)
        return tokens / shards * e * (2 * shape.hidden + max(2 * q + 2 * kvd, 3 * inter))

    prefill, decode = live(setup.batch * setup.max_len), live(setup.batch)
    lines.append(Line("activations", int(max(prefill, decode)),
                      f"one layer alive: tokens/{shards}*{e}*(2*hidden + max(2q+2kv, 3*inter)); "
                      f"prefill B*max_len {_gib(int(prefill))}, decode B*1 {_gib(int(decode))}"))
    vocab_split = m if shape.vocab % m == 0 else 1
    lines.append(Line("logits", int(setup.batch / shards * shape.vocab / vocab_split * (e + 4)),
                      f"B/{shards}*vocab/{vocab_split}*({e}+4): the last position only, "
                      "and its fp32 copy for sampling"))
    return f
