"""What AutoXLA's generation loop (generation/loop.py) asks of the dtensor runtime.

The loop is the xla runtime's: the prefill and decode steps, seeded sampling with transformers'
meaning, stop checks every few steps. Here each step runs eagerly with PyTorch's own kernels
(the executor's hooks gather each module's shards as it runs), so:

- there is no program to trace: a step is its Python function, called;
- nothing marks a layout: every tensor the loop makes is an ordinary tensor, the same on every
  rank (the sampling is a function of the seed and the step, not of an RNG state);
- no shapes to fix (``static_shapes = False``): a request keeps its own batch and prompt length,
  and the KV cache is transformers' ``DynamicCache``, grown a slot per step as transformers' loop
  grows it; each rank's layers hold the rows and heads it computes (the executor splits the
  batch and a tensor-parallel block's heads as the plan says). A static cache would attend over
  its empty slots through a mask at every step, where a grown one lets SDPA skip the mask
  (docs/benchmarks.md, "Runtimes");
- for the length of a call, what the modules gather is kept (``Executor.generating``): a
  decode step reads every weight, and gathering them all again at every token over gloo was
  ~80 % of a step with 2 or 4 processes. The cost is the gathered weights on every rank while
  the call runs, so they are kept only when they fit in ``KEEP_GATHERED_SHARE`` of the memory
  free on the rank's device, on every rank (one vote: ranks choosing differently would wait on
  each other's gathers forever); else each step gathers, as before, and ``kept_gathered`` says so.
  The modules whose tensors then stay as they are for the call lose their hooks until it ends
  (two Python calls per layer per step, ~2 % of a one-process decode step).

Compiling the decode step with ``torch.compile`` was measured and left out (docs/runtimes.md).
"""
from __future__ import annotations

import threading

import torch

from ...sharding.hosts import available_memory
from . import process

# The share of a rank's free memory that the weights gathered for one generate call may take
KEEP_GATHERED_SHARE = 0.5
# One generating thread per process at a time, as on the xla runtime: every rank's collectives
# must run in the same order.
_OWNER = threading.RLock()


class NotTraceable(RuntimeError):
    """Never raised here (nothing is traced); named so the loop treats both runtimes alike."""


class EagerPrograms:
    """``backend.TracedPrograms``' interface for steps that run as they are: ``get`` returns a
    program that calls the step's function."""

    def __init__(self, name: str):
        self.name = name

    def get(self, key, fn, inputs: list, weights: list = ()):
        return lambda inputs, weights=(): fn(inputs)


class DTensorGenerationEngine:
    """The device, the lock, the step programs and the layouts of generation on this runtime."""

    TracedPrograms = EagerPrograms
    NotTraceable = NotTraceable
    traces_steps = False        # each step runs as it is
    stacks_layers = False       # the scanned stack is the xla runtime's (modeling/scan.py)
    static_shapes = False       # nothing compiled: each call's own shapes, a growing cache

    def __init__(self, device: torch.device, executor, plan):
        self._device, self._executor, self._plan = device, executor, plan
        self.kept_gathered = False      # decided by generating(), for the call's Stats

    def generating(self):
        """The length of one generate call: the weights gathered once, when they fit."""
        gathered = self._plan.total_bytes() - self._plan.bytes_per_device()
        free = self.free_device_memory()
        fits = gathered == 0 or (free is not None and gathered <= KEEP_GATHERED_SHARE * free)
        # every rank must choose alike: one that keeps would skip the gathers another still issues
        self.kept_gathered = process.all_agree(fits, self._device)
        return self._executor.generating(keep=self.kept_gathered)

    def device(self) -> torch.device:
        return self._device

    def device_owner(self):
        return _OWNER

    def writes_files(self) -> bool:
        """Whether this process writes a job's shared files (logs, progress): process 0."""
        return process.rank() == 0

    def sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize()

    def finish_step(self) -> None:
        return None

    def compile_seconds(self) -> float:
        return 0.0                  # nothing compiles: steps run eagerly

    def compile_count(self) -> int:
        return 0

    def free_device_memory(self) -> int | None:
        """Bytes free on this rank's device: a GPU's own count; on the CPU the host's available
        memory shared by the ranks on it."""
        if self._device.type == "cuda":
            return torch.cuda.mem_get_info(self._device)[0]
        if self._device.type != "cpu":
            return None
        available = available_memory()
        return None if available is None else available // max(process.local_world_size(), 1)

    def mark_sharding(self, t: torch.Tensor, mesh, spec: tuple) -> torch.Tensor:
        return t                    # every rank holds the loop's tensors whole
