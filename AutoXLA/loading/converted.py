"""Tensors transformers 5 builds from several checkpoint tensors: fused experts.

Hub checkpoints of mixture-of-experts models (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...)
hold one tensor per expert (``experts.3.w1.weight``); transformers 5 keeps one ``[experts, ...]``
parameter per projection (``experts.gate_up_proj``) and builds it at load with a
``WeightConverter``: ``MergeModulelist(dim=0)`` stacks the experts, ``Concatenate(dim=1)`` puts
gate before up. ``compose`` reads those converters (transformers' own mapping for the model) into
a ``Composite``: which checkpoint tensor lands where in the target. ``Composite.host_shards``
then assembles each device's shard directly from the pieces, reading each piece once (the C core
reads and converts it) and copying only the part that device holds: host memory is the target's
shards plus one piece, never the whole layer, and a host of several reads only the experts its
devices hold.
"""
from __future__ import annotations

import math
import re
import types
from dataclasses import dataclass

import torch

from ..sharding import hosts
from .checkpoint import TensorRecord
from .streaming import read_blocks

# The converter operations whose result is a placement of whole pieces (no arithmetic).
_SUPPORTED = {("MergeModulelist", 0), ("Concatenate", 1)}


@dataclass(frozen=True)
class Piece:
    key: str                  # the checkpoint tensor
    at: tuple[int, ...]       # where its first element lands in the target


@dataclass(frozen=True)
class Composite:
    """A target tensor made of checkpoint pieces placed side by side (no overlap, no gaps)."""

    target: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def __str__(self) -> str:
        return f"{len(self.pieces)} checkpoint tensors ({self.pieces[0].key}, ...)"

    def check(self, records: dict[str, TensorRecord]) -> str:
        """"" when the pieces tile the target exactly, else what is wrong."""
        covered = 0
        for p in self.pieces:
            shape = (1,) * (len(self.shape) - len(records[p.key].shape)) + records[p.key].shape
            if any(a + s > n for a, s, n in zip(p.at, shape, self.shape)):
                return (f"checkpoint tensor {p.key!r} of shape {records[p.key].shape} does not fit "
                        f"at {p.at} in {self.target} {self.shape}")
            covered += records[p.key].nbytes // records[p.key].dtype.itemsize
        total = 1
        for n in self.shape:
            total *= n
        if covered != total:
            return (f"the {len(self.pieces)} checkpoint tensors of {self.target} hold {covered} "
                    f"values, the model's {self.shape} needs {total}: some experts are missing")
        return ""

    def host_shards(self, records: dict[str, TensorRecord], spec: tuple, mesh, host,
                    dtype: torch.dtype) -> tuple[dict[int, torch.Tensor], int]:
        """device -> its shard of the target for the devices ``host`` addresses, and the bytes
        read. Each piece is read (and converted to ``dtype`` by the C core) only if one of those
        shards needs it, then its overlap with each shard is copied in place."""
        def read(record, wanted):
            # only the part of the piece this host needs, when it is a block of a regular grid
            # over the piece (one rank's part always is: the plan's blocks are equal)
            lead = len(wanted) - len(record.shape)
            grid, block, box = _box_as_block(tuple(record.shape), wanted[lead:])
            values, nbytes = read_blocks(record, grid, [block], dtype)
            return {"": values[block]}, wanted[:lead] + box, nbytes

        shards, read_bytes = self.assemble(records, {"": (spec, self.shape, dtype)}, mesh, host, read)
        return shards[""], read_bytes

    def assemble(self, records: dict[str, TensorRecord], targets: dict, mesh, host, read
                 ) -> tuple[dict[str, dict[int, torch.Tensor]], int]:
        """({name: {device: shard}}, bytes read) of several tensors made from the same pieces:
        the target itself, or its quantized weight and scales (``targets``: name -> (spec,
        shape, dtype); ``read(record, wanted)`` -> (name -> the piece's values in that tensor,
        the box of the piece they cover, bytes read), ``wanted`` being the box of the piece
        (piece-local, in the target's rank) that this host's shards overlap; a reader may read
        more). The pieces span the target's last dim (experts are stacked and concatenated by
        rows), so a piece lands at the same place in every tensor along the other dims and fills
        its last one."""
        layouts = {}
        for name, (spec, shape, dtype) in targets.items():
            grid = hosts.shard_grid(spec, mesh)
            of_device = hosts.device_blocks(spec, mesh)
            wanted = sorted({of_device[d] for d in host.devices})
            boxes = {b: hosts.block_box(shape, grid, b) for b in wanted}
            blocks = _blocks_in_one_buffer({b: [hi - lo for lo, hi in box]
                                            for b, box in boxes.items()}, dtype)
            layouts[name] = (of_device, boxes, blocks)
        read_bytes = 0
        for p in self.pieces:
            record = records[p.key]
            shape = (1,) * (len(self.shape) - len(record.shape)) + tuple(record.shape)
            rows = [(a, a + s) for a, s in zip(p.at[:-1], shape[:-1])]
            overlaps = [o for _, boxes, _ in layouts.values() for box in boxes.values()
                        if (o := _intersect(rows, box[:-1])) is not None]
            if not overlaps:
                continue
            columns = (0, shape[-1])
            if len(layouts) == 1:       # one target: the piece's columns are the target's
                (_, boxes, _), = layouts.values()
                columns = _bounding_box([[box[-1]] for box in boxes.values()])[0]
            at = tuple(p.at[:-1]) + (0,)
            wanted = [(lo - a, hi - a) for (lo, hi), a in zip(_bounding_box(overlaps) + [columns], at)]
            values, got, nbytes = read(record, wanted)
            read_bytes += nbytes
            got = [(lo + a, hi + a) for (lo, hi), a in zip(got, at)]
            for name, (_, boxes, blocks) in layouts.items():
                value = values[name]
                value = value.reshape(tuple(hi - lo for lo, hi in got[:-1]) + value.shape[-1:])
                box = got[:-1] + [(got[-1][0], got[-1][0] + value.shape[-1])]
                for b, block_box in boxes.items():
                    region = _intersect(box, block_box)
                    if region is None:
                        continue
                    src = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(region, box))
                    dst = tuple(slice(lo - blo, hi - blo)
                                for (lo, hi), (blo, _) in zip(region, block_box))
                    blocks[b][dst].copy_(value[src])
            del values
        return {name: {d: blocks[of_device[d]] for d in host.devices}
                for name, (of_device, _, blocks) in layouts.items()}, read_bytes

    def read_whole(self, records: dict[str, TensorRecord], dtype: torch.dtype) -> torch.Tensor:
        """The whole target in ``dtype`` (``autoxla quantize`` writes it as one tensor)."""
        one = types.SimpleNamespace(axis_names=("all",), mesh_shape=(1,), device_ids=[0])
        spec = (None,) * len(self.shape)
        return self.host_shards(records, spec, one, hosts.Host.single(1), dtype)[0][0]


def _bounding_box(boxes: list) -> list[tuple[int, int]]:
    return [(min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0]))]


def _box_as_block(shape: tuple, box: list) -> tuple[tuple, int, list]:
    """(grid, block index, the block's box) of the block of a regular grid over a tensor of
    ``shape`` that is ``box``, dim by dim; a dim whose span is not one cell of an even split of
    it is taken whole."""
    grid, coords, got = [], [], []
    for n, (lo, hi) in zip(shape, box):
        size = hi - lo
        if 0 < size and n % size == 0 and lo % size == 0:
            grid.append(n // size), coords.append(lo // size), got.append((lo, hi))
        else:
            grid.append(1), coords.append(0), got.append((0, n))
    block = 0
    for c, parts in zip(coords, grid):
        block = block * parts + c
    return tuple(grid), block, got


def _blocks_in_one_buffer(shapes: dict, dtype: torch.dtype) -> dict:
    """Block -> an empty tensor of its shape, all views of one allocation: one large buffer is
    mapped and unmapped whole by malloc, where a few dozen blocks of some MiB each would be
    carved from (and kept in) its heap arenas, growing the process by a fused tensor per layer
    (measured: bench/moe_load.py)."""
    sizes = {b: math.prod(shape) for b, shape in shapes.items()}
    buffer = torch.empty(sum(sizes.values()), dtype=dtype)
    out, at = {}, 0
    for b, shape in shapes.items():
        out[b] = buffer[at:at + sizes[b]].view(shape)
        at += sizes[b]
    return out


def _intersect(a, b):
    out = [(max(lo1, lo2), min(hi1, hi2)) for (lo1, hi1), (lo2, hi2) in zip(a, b)]
    return out if all(lo < hi for lo, hi in out) else None


def compose(model, keys, converters, renamings, shapes: dict[str, tuple]) -> tuple[dict, list]:
    """(target name -> Composite, keys whose converter AutoXLA cannot place: name the op).

    ``converters`` and ``renamings`` are transformers' WeightConverter / WeightRenaming lists for
    ``model``; ``shapes`` is the model's parameter shapes by name."""
    from transformers.core_model_loading import apply_renamings

    placed: dict[str, list[tuple[int, int, str]]] = {}
    unsupported = []
    for key in sorted(keys):
        renamed = apply_renamings(key, renamings)
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is None:
                continue
            ops = tuple((type(o).__name__, getattr(o, "dim", None)) for o in converter.operations)
            expert = _expert_index(pattern, renamed)
            if not set(ops) <= _SUPPORTED or ops[0] != ("MergeModulelist", 0) or expert is None \
                    or target not in shapes:
                unsupported.append(f"{key} ({' then '.join(o for o, _ in ops)})")
            else:
                part = converter.source_patterns.index(pattern)
                placed.setdefault(target, []).append((expert, part, key))
            break
    composites = {}
    for target, entries in placed.items():
        parts = max(part for _, part, _ in entries) + 1
        rows = shapes[target][1] // parts if len(shapes[target]) > 1 else 0
        pieces = tuple(Piece(key, (expert, part * rows) + (0,) * (len(shapes[target]) - 2))
                       for expert, part, key in sorted(entries))
        composites[target] = Composite(target, tuple(shapes[target]), pieces)
    return composites, unsupported


def _expert_index(pattern: str, key: str) -> int | None:
    """The number ``*`` stands for in ``pattern`` (transformers' wildcard for the expert index)."""
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = re.search(regex, key)
    return int(found.group(1)) if found and found.groups() else None
