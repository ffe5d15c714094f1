"""This process's place in a multi-controller job: one process per device, torch.distributed.

Launched by torchrun (or ``launch.py``) the environment names the rank and the world; a process
started alone is a world of one. The process-group backend follows the device type: ``gloo`` on
the CPU, ``nccl`` on CUDA, ``tpu_dist`` on TorchTPU's ``tpu`` device.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "tpu": "tpu_dist"}
DEVICE_ENV = "AUTOXLA_DEVICE_TYPE"
# A collective that waits longer than this has lost a peer: fail with a message, not a hang.
TIMEOUT = timedelta(seconds=int(os.environ.get("AUTOXLA_DTENSOR_TIMEOUT", "300")))


def device_type() -> str:
    """The device the processes compute on: $AUTOXLA_DEVICE_TYPE, else cuda where there is one,
    else the CPU. (``tpu`` is chosen by name only: torch_tpu registers its device on a TPU VM.)"""
    chosen = os.environ.get(DEVICE_ENV)
    if chosen:
        if chosen not in BACKENDS:
            raise ValueError(f"{DEVICE_ENV}={chosen!r}: use one of {', '.join(BACKENDS)}")
        return chosen
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_types() -> dict[str, str | None]:
    """device type -> None where this machine can run it, else why not (autoxla doctor)."""
    import importlib.util

    out = {"cpu": None if dist.is_gloo_available() else "this torch has no gloo backend"}
    if not torch.cuda.is_available():
        out["cuda"] = "no CUDA device visible to this torch"
    else:
        out["cuda"] = None if dist.is_nccl_available() else "this torch has no nccl backend"
    out["tpu"] = (None if importlib.util.find_spec("torch_tpu") is not None else
                  "torch_tpu is not installed (pip install torch_tpu on a TPU VM: TorchTPU)")
    return out


def ensure_process_group(kind: str | None = None) -> None:
    """Join the job's process group (once): from torchrun's environment, or a world of one."""
    if dist.is_initialized():
        return
    kind = kind or device_type()
    if kind == "tpu":   # registers the tpu device and its process-group backend
        import torch_tpu  # noqa: F401  (unverified here: needs a TPU VM, docs/runtimes.md)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(BACKENDS[kind], timeout=TIMEOUT)


def default_group():
    """The job's process group (the default one), after ensure_process_group."""
    return dist.distributed_c10d._get_default_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_world_size() -> int:
    """The processes of the job on this machine (torchrun's LOCAL_WORLD_SIZE; else all of them)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def all_agree(flag: bool, device: torch.device) -> bool:
    """``flag`` on every process of the job (one small all-reduce): True only where all say True.
    For a choice each process makes from its own measurements that changes which collectives it
    issues: processes that chose differently would wait on each other forever."""
    if world_size() == 1:
        return flag
    vote = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    return bool(vote.item())
