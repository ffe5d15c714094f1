"""The xla runtime: torch_xla's SPMD, through AutoXLA/backend.py (the module that talks to it)."""
from __future__ import annotations

import contextlib

from .. import backend


class XlaRuntime:
    name = "xla"

    def device_count(self) -> int:
        return backend.device_count()

    def current_host(self):
        return backend.current_host()

    def make_mesh(self, shape, multislice=None):
        return backend.make_mesh(shape, multislice)

    def adopt_user_mesh(self, mesh):
        return backend.adopt_user_mesh(mesh)

    def pallas_target(self):
        return backend.pallas_target()

    def tensor_from_shards(self, shards, spec, mesh, shape, host=None):
        return backend.tensor_from_shards(shards, spec, mesh, shape, host)

    def wait_for_transfers(self) -> None:
        backend.wait_for_transfers()

    def generation_engine(self, model) -> "XlaGenerationEngine":
        return XlaGenerationEngine()


class XlaGenerationEngine:
    """What AutoXLA's generation loop asks of a runtime (generation/engine.py), from backend.py:
    steps traced once into XLA programs, layouts marked, the devices' lock and compile clock."""

    TracedPrograms = backend.TracedPrograms
    NotTraceable = backend.NotTraceable
    traces_steps = True                # each step traced once into an XLA program
    stacks_layers = True               # a scanned decoder stack (modeling/scan.py)
    static_shapes = True               # buckets and a static cache: one program per shape
    kept_gathered = False              # nothing to gather: the weights stay where the plan put them

    device = staticmethod(backend.device)
    device_owner = staticmethod(backend.device_owner)
    sync = staticmethod(backend.sync)
    finish_step = staticmethod(backend.finish_step)
    compile_seconds = staticmethod(backend.compile_seconds)
    compile_count = staticmethod(backend.compile_count)
    free_device_memory = staticmethod(backend.free_device_memory)

    @staticmethod
    def mark_sharding(t, mesh, spec: tuple):
        return backend.mark_sharding(t, mesh, spec)

    @staticmethod
    def writes_files() -> bool:
        """Whether this process writes a job's shared files (logs, progress): host 0."""
        return backend.current_host().index == 0

    @staticmethod
    def generating():
        return contextlib.nullcontext()     # the weights stay where the plan put them
