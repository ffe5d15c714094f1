"""The xla runtime: torch_xla's SPMD, through AutoXLA/backend.py (the module that talks to it)."""
from __future__ import annotations

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
