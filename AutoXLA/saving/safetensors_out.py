"""safetensors files written tensor by tensor, in any order, each at its final offset.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once; a streaming writer
knows the shapes and dtypes first (from the empty model), so it writes the header up front and
each tensor's bytes with pwrite when they exist. The header is the one save_file writes for the
same tensors: its order (dtype, then name) is taken from the library itself by saving one-element
stand-ins, so the files are byte for byte what save_file would write.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def _header(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], metadata: dict) -> tuple[
        bytes, dict[str, tuple[int, int]]]:
    """(the file's first bytes: length + JSON header, name -> (start, end) data offset)."""
    from safetensors.torch import save

    stand_ins = save({n: torch.zeros(1, dtype=d) for n, (_, d) in specs.items()}, metadata)
    n = int.from_bytes(stand_ins[:8], "little")
    order = json.loads(stand_ins[8:8 + n])      # the library's order and dtype names
    header, offsets, at = {}, {}, 0
    for name, info in order.items():
        if name == "__metadata__":
            header[name] = info
            continue
        shape, dtype = specs[name]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": info["dtype"], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        offsets[name] = (at, at + nbytes)
        at += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)             # save_file pads the header to 8 bytes
    return len(text).to_bytes(8, "little") + text, offsets


class ShardWriter:
    """Several safetensors files open at once; ``write(name, tensor)`` puts one tensor in its
    file. ``close()`` checks that every tensor of every file was written."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 groups: list[list[str]], paths: list[Path], metadata: dict | None = None):
        self.specs, self.where, self.fds, self.left = specs, {}, [], set(specs)
        try:
            for path, group in zip(paths, groups):
                head, offsets = _header({n: specs[n] for n in group}, metadata or {"format": "pt"})
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                self.fds.append(fd)
                _pwrite(fd, head, 0)
                size = len(head) + (max(e for _, e in offsets.values()) if offsets else 0)
                os.ftruncate(fd, size)
                self.where.update({n: (fd, len(head) + s) for n, (s, _) in offsets.items()})
        except BaseException:
            self.close(check=False)
            raise

    def write(self, name: str, t: torch.Tensor) -> None:
        shape, dtype = self.specs[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise RuntimeError(f"internal error: {name} is {t.dtype} {tuple(t.shape)}, its header "
                               f"says {dtype} {tuple(shape)}; please report")
        fd, offset = self.where[name]
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        _pwrite(fd, memoryview(data), offset)
        self.left.discard(name)

    def close(self, check: bool = True) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if check and self.left:
            raise RuntimeError(f"internal error: {sorted(self.left)[:5]} were never written; "
                               "please report")


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
