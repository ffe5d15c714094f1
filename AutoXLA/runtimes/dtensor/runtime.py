"""The dtensor runtime: what the shared pipeline asks of a runtime (runtimes/__init__.py),
answered with torch.distributed. Every process is a host with one device (its rank), so the
loader's multi-host path (sharding/hosts.py) reads exactly this rank's blocks, and each becomes
the local piece of a DTensor with the plan's placements, without communication."""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ... import saving
from ...sharding.hosts import Host
from ...sharding.mesh import MeshShape
from ...state import record_state, state_of
from . import process
from .execute import Executor, checkpoint_layers, run_on_the_mesh
from .generation import DTensorGenerationEngine
from .mesh import PlanMesh, adopt_device_mesh, make_mesh
from .placements import placements_for
from .saving import write_from_one_process


class DTensorRuntime:
    name = "dtensor"

    def __init__(self, device_type: str | None = None):
        self.device_type = device_type or process.device_type()
        self._executors = weakref.WeakKeyDictionary()     # model -> its Executor

    def start(self) -> None:
        process.ensure_process_group(self.device_type)

    def device(self) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, torch.accelerator.current_device_index())

    def device_count(self) -> int:
        self.start()
        return process.world_size()

    def current_host(self) -> Host:
        self.start()
        return Host(process.rank(), process.world_size(), (process.rank(),))

    def make_mesh(self, shape: MeshShape, multislice=None) -> PlanMesh:
        if multislice is not None:
            raise ValueError("multislice= is an xla-runtime option (DCN links between TPU "
                             "slices); on the dtensor runtime the process group spans the job")
        self.start()
        return make_mesh(shape, self.device_type)

    def adopt_user_mesh(self, mesh):
        """A user's DeviceMesh: (its axis sizes, the mesh to shard over); see mesh.py."""
        self.start()
        return adopt_device_mesh(mesh, self.device_type)

    def pallas_target(self):
        return None       # torch_tpu's Pallas ops are not wired in yet (docs/runtimes.md)

    def tensor_from_shards(self, shards: dict[int, torch.Tensor], spec: tuple, mesh: PlanMesh,
                           shape, host: Host | None = None) -> DTensor:
        """This rank's shard as the local piece of a DTensor laid out as the plan says."""
        local = shards[process.rank()].to(self.device())
        shape = tuple(shape)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh.device_mesh, placements_for(spec), run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def wait_for_transfers(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    def finish(self, model, plan, mesh: PlanMesh, gradient_checkpointing: bool = False):
        """Step 4 on this runtime: the modules gather their shards as they run (execute.py)."""
        self._executors[model] = executor = Executor(model, plan, mesh)
        run_on_the_mesh(model, executor)
        if gradient_checkpointing:
            checkpoint_layers(model)
        record_state(model, plan=plan, mesh=mesh, runtime=self)
        return saving.attach(model)      # save_pretrained gathers and writes once (write_whole)

    def place_adapters(self, model, adapters: dict, spec_of) -> None:
        """``shard_adapters`` on this runtime: each LoRA adapter (``adapters``: path -> peft's
        LoRA layer) becomes a DTensor with its planned placements (``spec_of(path, "lora_A")``),
        from process 0's values so that every process starts from the same adapters (peft draws
        A from each process's own generator), and the model's modules are hooked again to gather
        them as they run (execute.py: split like their base layer inside a tensor-parallel
        block)."""
        mesh = state_of(model).mesh
        for path, layer in adapters.items():
            for which in ("lora_A", "lora_B"):
                placements = placements_for(spec_of(path, which))
                for linear in getattr(layer, which).values():
                    w = linear.weight
                    if isinstance(w, DTensor):
                        continue          # placed by an earlier call
                    linear.weight = nn.Parameter(
                        distribute_tensor(w.detach().to(self.device()), mesh.device_mesh,
                                          placements, src_data_rank=0),
                        requires_grad=w.requires_grad)
        self._executors[model].adopt_new_tensors()

    def write_whole(self, tensors: dict, groups: list[list[str]], write) -> None:
        """saving/pretrained.py's writer on this runtime: see saving.py."""
        write_from_one_process(tensors, groups, write)

    def generation_engine(self, model):
        """What AutoXLA's generation loop asks of this runtime for ``model`` (generation.py)."""
        return DTensorGenerationEngine(self.device(), self._executors[model], state_of(model).plan)
