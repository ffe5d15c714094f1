"""save_pretrained from DTensors: every process takes part in gathering each tensor whole, and
process 0 alone writes the files, with the same writer and so the same bytes as the xla runtime
(saving/pretrained.py). Each tensor is gathered once, in the order the files list them; process
0 keeps one file's tensors at a time, the others one tensor at a time.

A failure on process 0 (a full disk, a directory it may not write) must not leave the others
waiting in a gather: process 0 runs the gathers it did not reach, then tells every process how
its writing ended, and all of them raise the same error."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import process

WRITER = 0


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on the host (a collective for a DTensor: call it on every process)."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.to("cpu").contiguous()


def write_from_one_process(tensors: dict[str, torch.Tensor], groups: list[list[str]],
                           write) -> None:
    """``write(copies)`` on process 0, ``copies`` yielding each group's tensors whole; every
    process gathers the same tensors in the same order."""
    error = None
    if process.rank() == WRITER:
        copies = ({n: whole(tensors[n]) for n in group} for group in groups)
        try:
            write(copies)
        except BaseException as e:   # reported to every process below, then raised here
            error = e
        for _ in copies:             # the gathers it did not reach
            pass
    else:
        for group in groups:
            for name in group:
                whole(tensors[name])
    ended = [None if error is None else f"{type(error).__name__}: {error}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(ended, src=WRITER)
    if error is not None:
        raise error
    if ended[0] is not None:
        raise RuntimeError(f"saving failed on process {WRITER}, which writes the files: "
                           f"{ended[0]}; its output has the details")
