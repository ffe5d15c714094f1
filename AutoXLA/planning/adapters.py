"""Where LoRA's adapters go: A and B of every wrapped projection, placed like their base layer.

A projection ``W [out, in]`` gets ``A [r, in]`` and ``B [out, r]`` (peft's shapes). A's input dim
is split the way W's is and B's output dim the way W's is, so ``B(A(x))`` meets the activations
in the layout the base's own matmul sees them: no adapter needs a gather the base does not, and
the adapters' bytes, gradients and optimizer states shrink with the mesh as the base's do. The
rank dim is never split (r is small, and it is contracted between A and B).

Plain data, like the Plan it extends: the forecast counts it (planning/memory.py), `autoxla plan
--train --lora-rank R` prints it and its JSON, and ``AutoXLA.training.shard_adapters`` applies it
to a peft model on the devices.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from ..sharding import rules
from ..sharding.mesh import format_spec

# Decoder layers' projections, unrolled: ``...layers.<i>.<path>.weight``.
_LAYER_WEIGHT = re.compile(r"\.layers\.\d+\..*\.weight$")
_LINEAR_ROLES = frozenset({rules.COLUMN, rules.ROW, rules.LINEAR})


@dataclass(frozen=True)
class AdapterTensor:
    name: str                 # as peft saves it, without its "base_model.model." prefix
    module: str               # the wrapped projection's module path in the unwrapped model
    shape: tuple[int, ...]
    spec: tuple
    shard_shape: tuple[int, ...]
    bytes_per_device: int


@dataclass(frozen=True)
class AdapterPlan:
    """LoRA of rank ``rank`` on the decoder layers' projections named ``targets`` (and on the
    lm_head when it is named), adapters in ``dtype`` (peft's default float32, whatever the
    base's dtype)."""

    rank: int
    dtype: str
    targets: tuple[str, ...]
    tensors: tuple[AdapterTensor, ...]

    def bytes_per_device(self) -> int:
        return sum(t.bytes_per_device for t in self.tensors)

    def total_bytes(self) -> int:
        return self.parameters() * _ELEMENT[self.dtype]

    def parameters(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    def spec_of(self, module: str, which: str) -> tuple:
        """The spec of ``which`` ("lora_A" or "lora_B") of the projection at ``module``."""
        index = self.__dict__.get("_index")
        if index is None:
            index = self.__dict__["_index"] = {t.name: t.spec for t in self.tensors}
        key = f"{module}.{which}.weight"
        if key not in index:
            raise KeyError(f"{module} is not among the planned adapters' projections "
                           f"({', '.join(self.targets)})")
        return index[key]

    def describe(self) -> str:
        modules = len(self.tensors) // 2
        example = {}
        for t in self.tensors:       # one line per projection kind and matrix, the first layer's
            kind = (t.module.rsplit(".", 1)[-1], t.name.rsplit(".", 2)[-2])
            example.setdefault(kind, t)
        lines = [f"LoRA adapters: rank {self.rank} on {modules} projections "
                 f"({', '.join(self.targets)}), {self.dtype}: {self.parameters():,} parameters, "
                 f"{self.total_bytes() / 2**20:.2f} MiB, {self.bytes_per_device() / 2**20:.2f} "
                 "MiB per device; A split like its base's input dim, B like its output dim:"]
        for (leaf, which), t in sorted(example.items()):
            lines.append(f"  {leaf}.{which}: {'x'.join(map(str, t.shape))} spec "
                         f"{format_spec(t.spec)} shard {'x'.join(map(str, t.shard_shape))}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bytes_per_device"] = self.bytes_per_device()
        return d


_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}


def plan_adapters(plan, rank: int, dtype: str = "float32",
                  targets: tuple[str, ...] | None = None) -> AdapterPlan:
    """The adapters of LoRA rank ``rank`` on ``plan``'s decoder-layer projections (``targets``:
    their module names, e.g. ("q_proj", "v_proj"); default every one, float or quantized), and
    on the lm_head when ``targets`` names it (tied to the embeddings or not: the adapter is its
    own tensor, placed like the head's weight; peft's "all-linear" leaves the head out, and so
    does the default here)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank {rank!r}: give a whole number >= 1 (--lora-rank R)")
    if dtype not in _ELEMENT:
        raise ValueError(f"adapter dtype {dtype!r}: use one of {', '.join(_ELEMENT)}")
    found = [t for t in plan.tensors if t.role in _LINEAR_ROLES and not t.tied_to
             and _LAYER_WEIGHT.search(t.name) and len(t.spec) == 2]
    if targets is not None:
        wanted = set(targets)
        found = [t for t in found if t.name.rsplit(".", 2)[-2] in wanted] + [
            t for t in plan.tensors if t.role == rules.LM_HEAD and len(t.spec) == 2
            and t.name.rsplit(".", 2)[-2] in wanted]
        missing = wanted - {t.name.rsplit(".", 2)[-2] for t in found}
        if missing:
            raise ValueError(f"no decoder-layer projection or head of {plan.model_class} is "
                             f"named {', '.join(sorted(missing))}")
    if not found:
        raise ValueError(f"{plan.model_class} has no linear projections in decoder layers to "
                         "wrap with LoRA")
    e, out = _ELEMENT[dtype], []
    for t in found:
        module = t.name[:-len(".weight")]
        # A quantized weight's codes are [out, in or in/2]; its float source may be stored
        # transposed (a Conv1D's [in, out]): out from the codes, in from the element count.
        out_features = t.shape[0]
        in_features = math.prod(t.source_shape) // out_features if t.backend else t.shape[1]
        out_axis, in_axis = t.spec
        for which, shape, spec in (("lora_A", (rank, in_features), (None, in_axis)),
                                   ("lora_B", (out_features, rank), (out_axis, None))):
            # a dim its axis does not divide (an odd int4 width) stays whole
            spec = tuple(a if s % plan.mesh.size(a) == 0 else None for s, a in zip(shape, spec))
            shard = tuple(s // plan.mesh.size(a) for s, a in zip(shape, spec))
            out.append(AdapterTensor(f"{module}.{which}.weight", module, shape, spec, shard,
                                     math.prod(shard) * e))
    names = tuple(sorted({t.module.rsplit(".", 1)[-1] for t in out}))
    return AdapterPlan(rank, dtype, names, tuple(out))
