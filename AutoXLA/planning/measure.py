"""Collectives and buffer sizes read from XLA's HLO text dumps (no XLA needed to parse).

The partitioned, optimized module (`*after_optimizations.txt`) shows every shape per device, so
an all-gather's result, a reduce-scatter's operand and an all-reduce's buffer are what one device
holds for the collective: the "payload" this module reports, the same quantity
planning/communication.py forecasts.
"""
from __future__ import annotations

import json
import math
import os
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


# ---- compiling a step and reading XLA's dump (this part runs torch_xla, in a child process) ----
# XLA reads its dump flags once per process, when its runtime starts: a step is compiled in a
# fresh interpreter with XLA_FLAGS set, and its partitioned module read from the dump directory.

@dataclass
class Measured:
    collectives: list[Collective]
    buffers: BufferStats
    module: str               # the dump file read


def measure_step(path, strategy: str, *, batch: int, seq: int, train: bool, dump_dir,
                 replicate_activations: bool = False, megatron_activations: bool = False,
                 free_gradients: bool = False,
                 timeout: float = 600) -> Measured:
    """Compile one training step (forward + backward, no optimizer) or one decode-shaped forward
    (``seq`` tokens, no cache) of the checkpoint at ``path`` on the 8 CPU devices; the collectives
    and buffer sizes of the partitioned program. ``replicate_activations`` injects a sharding
    mistake (every decoder layer's output forced replicated) for tests of the report;
    ``megatron_activations`` compiles Megatron's layout instead of the plan's (the residual
    stream whole on model, logits split by vocabulary), ``free_gradients`` leaves gradients
    unannotated (as before modeling/wrap.py gave them their parameters' sharding): both
    experiments for the bench's side-by-side comparisons."""
    flags = [f for f, on in (("replicate-activations", replicate_activations),
                             ("megatron-activations", megatron_activations),
                             ("free-gradients", free_gradients)) if on]
    dump_dir, _ = _run_child(path, strategy, batch, seq, "train" if train else "decode", flags,
                             dump_dir, timeout)
    # The step is the largest program (loading compiles small ones, if any).
    module = max(_modules(dump_dir), key=os.path.getsize)
    with open(module) as f:
        ops = collectives(f.read())
    with open(module.replace(".txt", "-buffer-assignment.txt")) as f:
        stats = buffer_stats(f.read())
    return Measured(ops, stats, module)


@dataclass
class MeasuredGeneration:
    batch: int                # the batch bucket generate padded to
    length: int               # the KV cache's length (slots)
    programs: list            # (dump file, parameter_buffers, BufferStats), one per program


def measure_generation(path, strategy: str, *, batch: int, prompt: int, dump_dir,
                       timeout: float = 600) -> MeasuredGeneration:
    """``model.generate`` of 3 tokens after a ``prompt``-token prompt, as users run it (scanned
    stack, static KV cache) on the 8 CPU devices; every compiled program's entry parameters and
    buffer sizes, so the KV cache can be found among the decode step's arguments."""
    dump_dir, out = _run_child(path, strategy, batch, prompt, "generate", [], dump_dir, timeout)
    sizes = json.loads(out.strip().splitlines()[-1])
    programs = []
    for module in sorted(_modules(dump_dir)):
        with open(module.replace(".txt", "-buffer-assignment.txt")) as f:
            text = f.read()
        programs.append((module, parameter_buffers(text), buffer_stats(text)))
    return MeasuredGeneration(sizes["batch"], sizes["length"], programs)


def _run_child(path, strategy, batch, seq, mode, flags, dump_dir, timeout):
    """Runs this module as a child with XLA's dump on; (its dump folder, its stdout)."""
    import subprocess
    import sys
    import tempfile

    os.makedirs(dump_dir, exist_ok=True)
    dump_dir = tempfile.mkdtemp(prefix=f"{strategy}-", dir=dump_dir)   # never a stale module
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} "
                         "--xla_dump_hlo_as_text")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "AutoXLA.planning.measure", os.fspath(path), strategy,
           str(batch), str(seq), mode, *flags]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"compiling the {strategy} {mode} step failed:\n{r.stderr[-3000:]}")
    return dump_dir, r.stdout


def _modules(dump_dir) -> list[str]:
    import glob

    modules = glob.glob(os.path.join(dump_dir, "*cpu_after_optimizations.txt"))
    if not modules:
        raise RuntimeError(f"XLA wrote no optimized module to {dump_dir}")
    return modules


def _child(path, strategy, batch, seq, mode, *flags):
    import json

    import torch

    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM, wrap

    dev = backend.device()
    if "megatron-activations" in flags:
        # An experiment, not the plan (modeling/wrap.py says why): the residual stream whole on
        # model (layer outputs and the embedding's lookup batch-split only), logits by vocabulary.
        def megatron(t, mesh, vocab=False):
            s = wrap.activation_spec(t, mesh)
            s = s if s is not None else (None,) * t.dim()
            return tuple(a if (a != "model" or vocab) else None for a in s)

        def shard(out, mesh):
            if isinstance(out, dict):
                items = [(v, k == "logits") for k, v in out.items()
                         if k in ("logits", "last_hidden_state")]
            else:
                items = [(out[0] if isinstance(out, (tuple, list)) else out, False)]
            for t, vocab in items:
                if isinstance(t, torch.Tensor) and t.device.type == "xla":
                    backend.mark_sharding(t, mesh, megatron(t, mesh, vocab))
        wrap.shard_output = shard
    if "free-gradients" in flags:
        wrap._shard_gradients_like_parameters = lambda model, mesh: None
    if "replicate-activations" in flags:
        def replicated(output, mesh):
            t = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(t, torch.Tensor) and t.device.type == "xla":
                backend.mark_sharding(t, mesh, (None,) * t.dim())
        wrap.shard_output = replicated
    if mode == "generate":    # the KV cache as generation allocates and passes it, scanned
        model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy)
        ids = torch.randint(3, 200, (int(batch), int(seq)),
                            generator=torch.Generator().manual_seed(0))
        model.generate(ids, max_new_tokens=3, do_sample=False)
        s = model.autoxla_last_generate
        print(json.dumps({"batch": s.batch_bucket, "length": s.cache_length}))
        return
    # Unrolled: a scanned stack's loop body holds one layer's collectives, run L times.
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy,
                                                    scan_layers=False)
    backend.sync()
    if "megatron-activations" in flags:
        mesh = model.autoxla_mesh
        model.get_input_embeddings().register_forward_hook(
            lambda _m, _i, out: wrap.shard_output(out, mesh))
    ids = torch.randint(3, 200, (int(batch), int(seq)), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)
    if mode == "train":
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        backend.sync()
    else:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        backend.sync()


if __name__ == "__main__":
    import sys

    _child(*sys.argv[1:])
