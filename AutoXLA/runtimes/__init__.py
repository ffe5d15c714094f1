"""The runtimes that execute a Plan.

- ``xla``: torch_xla's SPMD in one process per host (AutoXLA/backend.py and the kernels).
- ``dtensor``: PyTorch's own torch.distributed, one process per device, tensors as DTensors with
  the plan's placements (runtimes/dtensor/); the programming model of TorchTPU, CUDA and the CPU.

Everything before them is shared: the choices, the plan, quantization's decisions, the C core's
reads. What the shared pipeline asks of a runtime (modeling/pipeline.py) is ``Runtime`` below;
torch_xla and torch.distributed are imported only by the runtimes' own modules (pyproject.toml's
import-linter contract and tests/test_layers.py list them).
"""
from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from .dtensor import DTensorRuntime
from .xla import XlaRuntime

NAMES = ("xla", "dtensor")


class Runtime(Protocol):
    name: str

    def device_count(self) -> int: ...
    def current_host(self): ...                       # sharding.hosts.Host
    def make_mesh(self, shape, multislice=None): ...  # what the loader and the modules run on
    def adopt_user_mesh(self, mesh): ...              # (MeshShape, mesh) from the user's mesh=
    def pallas_target(self): ...                      # TPU generation for Pallas, or None
    def tensor_from_shards(self, shards: dict, spec: tuple, mesh, shape, host=None) -> torch.Tensor: ...
    def wait_for_transfers(self) -> None: ...


def unavailable(name: str) -> str | None:
    """Why runtime ``name`` cannot run in this environment, or None when it can."""
    if name == "xla":
        if importlib.util.find_spec("torch_xla") is None:
            return "torch_xla is not installed (pip install 'torch==2.9.0' 'torch_xla==2.9.0')"
        return None
    if name == "dtensor":
        if not torch.distributed.is_available():
            return f"this torch {torch.__version__} was built without torch.distributed"
        return None
    raise ValueError(f"unknown runtime {name!r}; use one of {', '.join(NAMES)}")


def default() -> str:
    """xla where torch_xla is installed (unchanged behaviour), else dtensor."""
    return "xla" if unavailable("xla") is None else "dtensor"


def check_name(name) -> str | None:
    if name is not None and name not in NAMES:
        raise ValueError(f"runtime={name!r}: use one of {', '.join(NAMES)}, or leave it unset for "
                         f"the installed one ({default()} here)")
    return name


def select(name: str | None = None) -> Runtime:
    name = check_name(name) or default()
    why = unavailable(name)
    if why:
        raise ImportError(f"runtime {name!r} cannot run here: {why}")
    return XlaRuntime() if name == "xla" else DTensorRuntime()
