"""Collectives and buffer sizes read from XLA's HLO text dumps (pure text parsing: no XLA, no
model; the runtime harness that compiles a step and dumps it is evaluation/measure.py).

The partitioned, optimized module (`*after_optimizations.txt`) shows every shape per device, so
an all-gather's result, a reduce-scatter's operand and an all-reduce's buffer are what one device
holds for the collective: the "payload" this module reports, the same quantity
planning/communication.py forecasts.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1}

# "%name = TYPE opcode(operands), attrs"; TYPE may be a tuple (async starts, combined ops).
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")


@dataclass(frozen=True)
class Collective:
    kind: str                 # one of KINDS (an async -start is counted as its op)
    name: str
    dtype: str
    shape: tuple[int, ...]    # the larger side per device: gathered result / unreduced operand
    group_size: int           # devices that take part together
    payload_bytes: int        # bytes of `shape` on one device

    @property
    def shape_str(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(type_text)]


def _nbytes(arrays) -> int:
    return sum(math.prod(s) * DTYPE_BYTES.get(d, 4) for d, s in arrays)


def group_size(attrs: str, num_devices: int) -> int:
    """Devices per replica group: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[8]`, or all."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)   # collective-permute
    if m:
        return 2
    return num_devices


def collectives(hlo_text: str, num_devices: int = 8) -> list[Collective]:
    """Every collective of an HLO module's text, in order. Operands are printed by name only, so
    their shapes come from the instruction that defines them."""
    instrs = [m.groups() for m in map(_INSTR.match, hlo_text.splitlines()) if m]
    types = {name: type_text for name, type_text, _, _ in instrs}   # HLO order is free: 2 passes
    found = []
    for name, type_text, op, rest in instrs:
        kind = op.removesuffix("-start")
        if kind not in KINDS or op.endswith("-done"):
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        sides = [_arrays(type_text)] + [_arrays(types.get(o, "")) for o in operands]
        # An async start's type is a tuple (operands, results): its largest array is the payload.
        arrays = max((a for side in sides for a in side), key=lambda a: math.prod(a[1]), default=None)
        if arrays is None:
            continue
        dtype, shape = arrays
        found.append(Collective(kind=kind, name=name, dtype=dtype, shape=shape,
                                group_size=group_size(rest, num_devices),
                                payload_bytes=_nbytes([arrays])))
    return found


def count_by_kind(ops: list[Collective]) -> dict[str, tuple[int, int]]:
    """kind -> (number of ops, payload bytes)."""
    n, b = Counter(), Counter()
    for o in ops:
        n[o.kind] += 1
        b[o.kind] += o.payload_bytes
    return {k: (n[k], b[k]) for k in KINDS if n[k]}


@dataclass(frozen=True)
class BufferStats:
    """Bytes per device of a compiled program, from XLA's buffer assignment."""

    argument: int     # entry parameters (weights, inputs)
    output: int       # live-out buffers not aliased to a parameter
    temp: int         # everything else XLA allocates while the program runs
    total: int        # XLA's "Total bytes used"


def buffer_stats(assignment_text: str) -> BufferStats:
    """Parse a `*buffer-assignment.txt` dump: each `allocation N: size S, <tags>:` line once."""
    arg = out = temp = 0
    for m in re.finditer(r"^allocation \d+: size (\d+), (.*?):?$", assignment_text, re.M):
        size, tags = int(m.group(1)), m.group(2)
        if "parameter" in tags:
            arg += size
        elif "constant" in tags or "thread-local" in tags:
            continue        # read-only data and per-thread scratch of a fusion's loop
        elif "live-out" in tags or "output" in tags:
            out += size
        else:
            temp += size
    total = re.search(r"Total bytes used: (\d+)", assignment_text)
    return BufferStats(argument=arg, output=out, temp=temp,
                       total=int(total.group(1)) if total else arg + out + temp)


def parameter_buffers(assignment_text: str) -> list[tuple[str, int]]:
    """The entry parameters of a `*buffer-assignment.txt` dump: (shape per device as XLA prints
    it, e.g. "f32[8,1,32,16]", bytes), one per allocation that holds a parameter."""
    out = []
    for m in re.finditer(r"^allocation \d+: size (\d+), parameter \d+, shape \|([^|]+)\|",
                         assignment_text, re.M):
        out.append((m.group(2).split("{")[0], int(m.group(1))))
    return out


# On XLA:CPU a reduce-scatter is emitted as an all-reduce then a slice (the pass that fuses the
# pair runs only in the TPU/GPU pipelines): both count as a reduction of the same payload.
_CLASS = {"all-gather": "gather", "reduce-scatter": "reduce", "all-reduce": "reduce",
          "all-to-all": "all-to-all", "collective-permute": "permute"}


def _key(kind: str, shape_str: str, group: int) -> tuple:
    dtype, dims = shape_str.split("[", 1)
    shape = tuple(sorted(int(x) for x in dims.rstrip("]").split(",") if x and x != "1"))
    return (_CLASS[kind], dtype, shape, group)


@dataclass
class Comparison:
    """Forecast ops matched against measured ones by (gather/reduce, dtype, dims, group size);
    dims are compared as a multiset since a transposed layout gathers the same bytes."""

    matched: list = None       # (forecast CommOp, measured count)
    unexpected: list = None    # measured Collectives the forecast did not predict
    missing: list = None       # forecast CommOps not found (count left over)

    def describe(self) -> str:
        lines = []
        if self.unexpected:
            lines.append("collectives the plan did not predict (op, shape per device, group, count):")
            c = Counter((o.kind, o.shape_str, o.group_size) for o in self.unexpected)
            for (kind, shape, g), n in sorted(c.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {kind:<18} {shape:<20} over {g}  x{n}")
        if self.missing:
            lines.append("forecast collectives not found in the program (op, shape, group, "
                         "count, e.g.):")
            c, example = Counter(), {}
            for op, n in self.missing:
                key = (op.kind, op.shape_str, op.group_size)
                c[key] += n
                example.setdefault(key, f"{op.what}, {op.phase}")
            for (kind, shape, g), n in sorted(c.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {kind:<18} {shape:<20} over {g}  x{n}  ({example[(kind, shape, g)]})")
        return "\n".join(lines) or "every collective as forecast"


def compare(report, measured: list[Collective]) -> Comparison:
    """Match a CommReport's ops against the collectives of a compiled step."""
    pool: dict[tuple, list[Collective]] = {}
    for o in measured:
        pool.setdefault(_key(o.kind, o.shape_str, o.group_size), []).append(o)
    matched, missing = [], []
    for op in report.ops:
        bucket = pool.get(_key(op.kind, op.shape_str, op.group_size), [])
        take = min(op.count, len(bucket))
        del bucket[:take]
        if take:
            matched.append((op, take))
        if take < op.count:
            missing.append((op, op.count - take))
    unexpected = [o for bucket in pool.values() for o in bucket]
    return Comparison(matched, unexpected, missing)
