"""The one place that talks to torch_xla.

torch_xla is imported lazily, so that planning and the CLI's `plan` command work on machines
without it; and the surface we use is kept small because PyTorch/XLA is expected to be replaced by
a native TPU backend (docs/architecture.md).

One module at ~610 lines on purpose: it is the whole surface a second runtime (TorchTPU) must
provide, and keeping it in one file keeps that surface readable as a list.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading

import numpy as np
import torch

from .module_swap import repointing_references
from .sharding.hosts import Host, available_memory
from .sharding.mesh import AXES, MeshShape, canonical_device_ids, validate_mesh_axes
from .sharding.multislice import device_order


# Virtual XLA:CPU devices share this host's cores and memory: more than this is a typo.
MAX_CPU_DEVICES = 256


def use_cpu_devices(count: int = 8) -> None:
    """Ask for ``count`` virtual XLA:CPU devices, unless the environment already chose a device.

    Must run before torch_xla starts its runtime; tests, the demo and the benchmarks call it.
    """
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_CPU_DEVICES:
        raise ValueError(f"{count!r} virtual CPU devices: use 1 to {MAX_CPU_DEVICES} (XLA:CPU "
                         "starts one client per device; 8 is what the tests and the demo use)")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    if os.environ["PJRT_DEVICE"] == "CPU":
        os.environ.setdefault("CPU_NUM_DEVICES", str(count))


def _answer_missing_jax_at_once() -> None:
    """Make the imports of JAX and torchax that torch_xla retries fail at once when JAX is absent.

    torch_xla's `mark_sharding` tries `import torchax` and `import jax` on every call; without JAX
    both fail, and the torchax copy in the torch_xla wheel runs its package code before failing.
    Measured (8 virtual devices, a busy 2-core machine): 0.80 ms per mark_sharding, 0.09 ms with
    the imports answered at once; paid on every traced step (54 calls per 8 decode steps). A None
    in sys.modules is Python's way to say "not importable": the import raises ModuleNotFoundError
    at once and `importlib.util.find_spec` answers None, as before. Where JAX is installed (a TPU,
    the emulated kernels) nothing changes.
    """
    if importlib.util.find_spec("jax") is None:
        for name in ("jax", "torchax"):
            sys.modules.setdefault(name, None)


@functools.cache
def _xla():
    _answer_missing_jax_at_once()
    try:
        import torch_xla
        import torch_xla.runtime as xr
        import torch_xla.distributed.spmd as xs
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError(
            "AutoXLA needs torch_xla to load models onto XLA devices: "
            "pip install 'torch==2.9.0' 'torch_xla==2.9.0'") from e
    return torch_xla, xr, xs


class SPMDOrderError(RuntimeError):
    """torch_xla handed out its XLA device before SPMD was on; this process cannot run SPMD."""


_SPMD_ORDER_FIX = (
    "torch_xla cannot switch such a process to SPMD: its tensors stay on one device and the "
    "first sharded program crashes with SIGSEGV (pytorch/xla#9735). To fix it, start SPMD before "
    "the first torch_xla.device() / xm.xla_device() / XLA tensor / xm.set_rng_state(): load the "
    "model first, or call AutoXLA.backend.device() (it returns the device to use) or "
    "torch_xla.runtime.use_spmd() at the top of the script, or set XLA_USE_SPMD=1 in the "
    "environment before starting Python. Then restart the process")


def ensure_spmd() -> None:
    """Turn on SPMD once, before any device is touched (torch_xla segfaults otherwise, #9735).

    Raises SPMDOrderError, before anything is placed on a device, when it is already too late:
    torch_xla fixes which device "xla" means the first time it hands out a device (
    torch_xla.device(), an XLA tensor, xm.set_rng_state, ...), and use_spmd() after that leaves
    new tensors on the physical device, so the first SPMD program segfaults. Asking for the
    device count or the device type does not fix it and stays harmless.
    """
    torch_xla, xr, _ = _xla()
    if not xr.is_spmd():
        if torch_xla._XLAC._xla_get_spmd_config_is_locked():
            # use_spmd() would only warn and go on to the crash; it would also set XLA_USE_SPMD,
            # so a second call would no longer see this.
            raise SPMDOrderError(
                "torch_xla's XLA device was already in use without SPMD before AutoXLA needed "
                "it (torch_xla.device(), xm.xla_device(), an XLA tensor or xm.set_rng_state() "
                "came first). " + _SPMD_ORDER_FIX)
        xr.use_spmd()
    _check_spmd_device()
    _start_autograd_on_xla()


@functools.cache   # succeeds once per process; the mapping it checks never changes afterwards
def _check_spmd_device() -> None:
    """SPMD is on: check that new XLA tensors really land on the SPMD virtual device.

    They do not when SPMD was turned on (by torch_xla.runtime.use_spmd() or XLA_USE_SPMD set
    in os.environ) only after torch_xla had handed out its device.
    """
    torch_xla, _, _ = _xla()
    real_devices = getattr(torch_xla._XLAC, "_xla_real_devices", None)
    if real_devices is None:    # pragma: no cover - older or newer torch_xla without it
        return
    real = real_devices([str(torch_xla.device())])[0]
    if not real.startswith("SPMD:"):
        raise SPMDOrderError(
            f"SPMD is on but torch_xla's XLA device is the physical device {real}, not the SPMD "
            "virtual device: torch_xla.device() (or an XLA tensor, or xm.set_rng_state()) came "
            "before SPMD was turned on (torch_xla.runtime.use_spmd() or XLA_USE_SPMD=1 came "
            "too late). " + _SPMD_ORDER_FIX)


@functools.cache   # once per process (SPMD may already be on from the environment)
def _start_autograd_on_xla() -> None:
    """Run a one-element backward on the XLA device before anything else can.

    autograd sizes its per-device queues once, at the first backward pass of the process, from the
    devices it can see then. If that first backward ran on the CPU before torch_xla's runtime was
    up, XLA gets no queue and every later backward on an XLA tensor fails with an internal assert
    ("device_ready_queues_"). Starting autograd here prevents that; if it is already too late,
    say so now, in words, rather than at the first training step.
    """
    import warnings

    torch_xla, _, _ = _xla()
    x = torch.ones(2, device=torch_xla.device(), requires_grad=True)
    try:
        # Lazy: nothing is compiled or run. The multiply matters: a graph that is only a leaf's
        # sum fails the same assert on XLA even as the first backward (torch 2.9, observed).
        (x * 2).sum().backward()
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        warnings.warn(
            "autograd was first used (a backward pass on the CPU) before the XLA runtime started, "
            "so backward passes on XLA devices will fail in this process (inference is "
            "unaffected). To train, load the model, or call AutoXLA.backend.device(), before the "
            "first backward pass, e.g. at the top of the script", RuntimeWarning, stacklevel=3)


def device() -> torch.device:
    ensure_spmd()
    torch_xla, _, _ = _xla()
    return torch_xla.device()


def device_count() -> int:
    ensure_spmd()
    _, xr, _ = _xla()
    return xr.global_runtime_device_count()


def sync() -> None:
    torch_xla, _, _ = _xla()
    torch_xla.sync()


def finish_step() -> None:
    """After launching one step of a loop that launches the next at once: on XLA:CPU with more
    than one device, wait for it to finish.

    XLA:CPU gives every execution's collectives the same rendezvous key (RunId 0), so when steps
    are launched back to back a fast device can enter step n+1's all-reduce while a slow one is
    still in step n's, and the runtime aborts the process after 10 s ("Expected 8 threads to join
    the rendezvous, but only 7 of them arrived": 2 of 8 runs of 128 decode steps launched back
    to back, 8 virtual devices). Elsewhere the next step is traced while this one runs.
    """
    if _serial_devices():
        wait_for_transfers()


@functools.cache
def _serial_devices() -> bool:
    return not on_tpu() and device_count() > 1


def make_mesh(shape: MeshShape, multislice=None):
    """A torch_xla Mesh over all devices with axes ("data", "fsdp", "model").

    With a ``sharding.multislice.MultiSlice`` of several slices, the axes are split into their
    DCN and ICI parts: on TPU torch_xla's ``HybridMesh`` orders the devices (by slice, then by the
    physical torus); elsewhere slices are consecutive device ids (``multislice.device_order``),
    which is how the tests stand in for slices on XLA:CPU."""
    _, _, xs = _xla()
    n = device_count()
    if shape.num_devices != n:
        raise ValueError(f"mesh {shape} needs {shape.num_devices} devices, the runtime has {n}")
    if multislice is None or multislice.slices == 1:
        return xs.Mesh(np.arange(n), shape.sizes, AXES)

    ici, dcn = multislice.split(shape)
    if on_tpu():
        try:
            return xs.HybridMesh(ici_mesh_shape=ici.sizes, dcn_mesh_shape=dcn.sizes,
                                 axis_names=AXES)
        except ValueError as e:
            raise ValueError(f"torch_xla could not lay out {multislice.slices} slices ({e}); "
                             "check that the job runs on that many slices (MEGASCALE_* settings, "
                             "docs/multihost.md), or drop multislice=") from e
    return xs.Mesh(np.asarray(device_order(ici, dcn)), shape.sizes, AXES)


def adopt_user_mesh(mesh):
    """Validates a user-supplied torch_xla Mesh; returns (its axis sizes, the mesh to shard over).

    A mesh with all three axes is used as it is. One with a subset of them (the original
    AutoXLA's ``("fsdp", "model")``, ``("data",)``, ...) is replaced by the ``(data, fsdp,
    model)`` mesh that places every device at the same coordinates, so the plan's specs (which
    name all three axes) apply and the user's own annotations on their mesh stay consistent.
    """
    names = getattr(mesh, "axis_names", None)
    sizes = getattr(mesh, "mesh_shape", None)
    if sizes is None or not hasattr(mesh, "get_op_sharding"):
        raise TypeError(f"mesh must be a torch_xla.distributed.spmd.Mesh, got {type(mesh).__name__}")
    shape = validate_mesh_axes(names, sizes, device_count())
    if set(names or ()) == set(AXES):
        return shape, mesh
    _, _, xs = _xla()
    ids = canonical_device_ids(mesh.device_ids, sizes, names)
    return shape, xs.Mesh(np.asarray(ids), shape.sizes, AXES)


def patch_linear_for_spmd(model) -> None:
    """torch_xla's einsum-based nn.Linear (``xla_sharding.apply_xla_patch_to_nn_linear``), so that
    sharding propagates through linears. Not ``fsdp.utils.apply_xla_patch_to_nn_linear``, which
    shares the name and patches the backward for FSDPv1 (TORCH_XLA_NOTES.md)."""
    _xla()
    from torch_xla.distributed.spmd.xla_sharding import apply_xla_patch_to_nn_linear

    with repointing_references(model):
        apply_xla_patch_to_nn_linear(model)


def set_global_mesh(mesh) -> None:
    _, _, xs = _xla()
    xs.set_global_mesh(mesh)


def replicated(t: torch.Tensor) -> torch.Tensor:
    """``t`` marked replicated over the global mesh (if one is set), so reading it to the host
    after a sync is a plain copy: a sharded result needs a gathering program, compiled anew
    for every read."""
    _, _, xs = _xla()
    mesh = xs.get_global_mesh()
    if mesh is not None:
        xs.mark_sharding(t, mesh, (None,) * t.dim())
    return t


def current_host():
    """This process's ``sharding.hosts.Host``: its index, the process count and the global ids of
    the devices it addresses (torch_xla's runtime), or the simulated host that
    ``AUTOXLA_SIMULATE_HOST=i/P`` names (docs/multihost.md)."""
    torch_xla, xr, _ = _xla()
    n = device_count()
    simulated = Host.from_env(n)
    if simulated is not None:
        return simulated
    if xr.process_count() == 1:
        return Host.single(n)
    # "TPU:5": PJRT's global device id; each process lists only the devices it addresses.
    local = tuple(int(d.rsplit(":", 1)[1]) for d in torch_xla._XLAC._xla_get_runtime_devices())
    return Host(xr.process_index(), xr.process_count(), local)


def tensor_from_shards(shards: dict[int, torch.Tensor], spec: tuple, mesh, shape,
                       host=None) -> torch.Tensor:
    """A sharded XLA tensor from host shards: ``shards`` maps every device ``host`` addresses
    (default: all of them) to its shard.

    Unlike ``t.to(device)`` followed by ``mark_sharding``, this never places the whole tensor on
    one device first (docs/benchmarks.md measures the difference). On a multi-process runtime
    torch_xla takes the addressed devices' shards only. A simulated host has every device in its
    one process: the devices it does not own get NaN (0 for integers), so a test that read them
    would fail loudly rather than see another host's data.
    """
    torch_xla, _, _ = _xla()
    ensure_spmd()
    op = mesh.get_op_sharding(tuple(spec))
    if host is None or host.is_everything:
        ordered = [shards[d] for d in range(len(shards))]
    elif host.simulated:
        like = next(iter(shards.values()))
        fill = float("nan") if like.is_floating_point() else 0
        ordered = [shards[d] if d in shards else torch.full_like(like, fill)
                   for d in range(device_count())]
    else:
        ordered = [shards[d] for d in host.devices]
    return torch_xla._XLAC._global_tensor_from_cpu_shards(ordered, op, list(shape))


def wait_for_transfers() -> None:
    """Blocks until pending host-to-device copies finish, so their host buffers can be freed."""
    torch_xla, _, _ = _xla()
    torch_xla._XLAC._xla_wait_device_ops(devices=[])


def constrain(t: torch.Tensor, spec: tuple) -> torch.Tensor:
    """``t`` (an activation inside a model's forward) annotated with ``spec`` over the global
    mesh, its gradient too; unchanged off XLA or without a global mesh."""
    if t.device.type != "xla":
        return t
    _, _, xs = _xla()
    mesh = xs.get_global_mesh()
    if mesh is None:
        return t
    return xs.mark_sharding_with_gradients(t, mesh, tuple(spec))


def mark_sharding(t: torch.Tensor, mesh, spec: tuple, with_gradients: bool = False):
    _, _, xs = _xla()
    if with_gradients:
        return xs.mark_sharding_with_gradients(t, mesh, tuple(spec))
    xs.mark_sharding(t, mesh, tuple(spec))
    return t


def shard_like(t: torch.Tensor, source: torch.Tensor) -> None:
    """Annotates ``t`` with ``source``'s sharding (a gradient with its parameter's), if any."""
    torch_xla, _, _ = _xla()
    if torch_xla._XLAC._get_xla_sharding_type(source) is None:
        return
    torch_xla._XLAC._xla_mark_sharding(t, torch_xla._XLAC._get_xla_op_sharding(source))


# One thread at a time traces and runs programs on the devices: torch_xla's lazy graph and its
# device data are not safe to drive from two threads (two concurrent generate calls crashed the
# process, SIGSEGV). Re-entrant, so a call that holds it may call another (warm-up -> generate).
_DEVICE_OWNER = threading.RLock()


def device_owner():
    """The lock a thread holds while it drives the devices (``with backend.device_owner():``)."""
    return _DEVICE_OWNER


def free_device_memory() -> int | None:
    """Bytes free on one device now: a TPU's HBM limit less what is in use; on XLA:CPU the
    host's available memory shared by the virtual devices; None when the runtime cannot say."""
    if on_tpu():
        _xla()
        import torch_xla.core.xla_model as xm

        try:
            info = xm.get_memory_info(device())
            return int(info["bytes_limit"]) - int(info["bytes_used"])
        except (RuntimeError, KeyError, TypeError):
            return None
    available = available_memory()
    return None if available is None else available // max(device_count(), 1)


def sharding_spec(t: torch.Tensor) -> str:
    """XLA's sharding string for ``t`` ("" when unsharded); call after sync()."""
    torch_xla, _, _ = _xla()
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def scan_loop(fn, init, xs, reverse: bool = False):
    """torch_xla's scan loop without its autograd layer: ``fn(carry, x) -> (carry, y)`` traced
    once into an XLA While whose body runs once per leading index of ``xs``; returns (carry,
    stacked ys). Tensors ``fn`` reads from its closure become loop inputs (read-only). The public
    ``scan`` traces ``fn`` with AOTAutograd instead, which refuses closures over device tensors
    and integer carries, and saves every step's activations even when no gradient is wanted.
    """
    _xla()
    from torch_xla.experimental.scan import _scan_impl_pytree

    return _scan_impl_pytree(fn, init, xs, reverse=reverse)


def activation_checkpoint(function, *args, **kwargs):
    """torch_xla's activation checkpoint (re-entrant; an optimization barrier keeps XLA from
    merging the recomputed forward back into the first)."""
    _xla()
    from torch_xla.utils.checkpoint import checkpoint
    return checkpoint(function, *args, **kwargs)


def fsdpv2():
    """torch_xla's SpmdFullyShardedDataParallel and the helpers that go with it."""
    _xla()
    from torch_xla.distributed.fsdp.utils import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel,
    )
    return SpmdFullyShardedDataParallel, transformer_auto_wrap_policy, checkpoint_module


def _metric(name: str) -> tuple[int, float]:
    """(samples, accumulated value) of torch_xla's metric ``name`` in this process."""
    _xla()
    import torch_xla.debug.metrics as met
    data = met.metric_data(name)
    return (int(data[0]), float(data[1])) if data else (0, 0.0)


def _metric_count(name: str) -> int:
    """How many samples torch_xla's metric ``name`` has recorded in this process."""
    return _metric(name)[0]


def compile_count() -> int:
    """Number of XLA compilations so far in this process."""
    return _metric_count("CompileTime")


def compile_seconds() -> float:
    """Time spent compiling so far in this process (the metric accumulates nanoseconds)."""
    return _metric("CompileTime")[1] / 1e9


def on_tpu() -> bool:
    """True when the XLA devices are TPUs (the Pallas kernels run only there)."""
    if os.environ.get("PJRT_DEVICE", "").upper() not in ("", "TPU"):
        return False
    _, xr, _ = _xla()
    return xr.device_type() == "TPU"


def runs_pallas() -> bool:
    """True when AutoXLA's Pallas call sites take their TPU branch: on a TPU, or off one once
    kernels/interpret.py has switched this process to the emulated (interpreted) kernels."""
    return pallas_target() is not False


def has_quantized_matmul() -> bool:
    """Whether torch_xla (which provides torch.ops.xla.quantized_matmul) is installed; checked
    without importing it, so that planning stays free of torch_xla."""
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


def quantized_matmul():
    """torch.ops.xla.quantized_matmul (registered by importing its module)."""
    _xla()
    import torch_xla.experimental.xla_quantized_matmul  # noqa: F401  (registers the op)
    return torch.ops.xla.quantized_matmul


def tpu_generation() -> int | None:
    """The TPU's generation (4, 5, 6, ...), or None off a TPU (the emulated kernels included)."""
    if not on_tpu():
        return None
    from torch_xla._internal import tpu
    return int(tpu.version())


# Set once by kernels/interpret.enable(), which swaps the Pallas kernels for their interpret-mode
# emulation in this process; read here, so the runtime's answers need no import of the kernels.
_EMULATED_TPU_KERNELS = False


def record_emulated_tpu_kernels() -> None:
    global _EMULATED_TPU_KERNELS
    _EMULATED_TPU_KERNELS = True


def emulating_tpu_kernels() -> bool:
    return _EMULATED_TPU_KERNELS


def pallas_target():
    """Where the Pallas kernels would run, as quantization/backends.py's ``tpu`` reads it: the
    TPU generation, True for the emulated kernels, False when they cannot run."""
    if _EMULATED_TPU_KERNELS:
        return True
    return tpu_generation() or False


def pallas_quantized_matmul(x, w, scale, *, quantize_activation: bool, batch_block_size: int,
                            out_block_size: int, in_block_size: int) -> torch.Tensor:
    """torch_xla's Pallas int8 matmul kernel with the tiles given, through ``call_jax`` (its op,
    ``torch.ops.xla.quantized_matmul_int8``, looks tiles up itself and silently runs XLA's
    matmul on a miss). Under the global mesh each device runs the kernel on its own block inside
    torch_xla's manual-sharding region, as torch_xla's own kernel wrappers do: rows over
    (data, fsdp) when they divide, outputs over model when they divide; the contraction is
    whole on each device (the weight gathered over it, as FSDP does for a plain linear)."""
    _, _, xs = _xla()
    from torch_xla.core.xla_builder import call_jax
    from torch_xla.experimental.pallas_kernels.quantized_matmul_kernel import (
        quantized_matmul_int8)

    kwargs = {"quantize_activation": quantize_activation, "batch_block_size": batch_block_size,
              "out_block_size": out_block_size, "in_block_size": in_block_size}
    mesh = xs.get_global_mesh()
    if mesh is None:
        return call_jax(quantized_matmul_int8, (x, w, scale), kwargs)
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    rows = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
    row_shards = int(np.prod([sizes[a] for a in rows])) if rows else 1
    rows = rows if rows and x.shape[0] % row_shards == 0 else None
    outs = "model" if sizes.get("model", 1) > 1 and w.shape[0] % sizes["model"] == 0 else None
    local_x = xs.enable_manual_sharding(_graph_node(x), (rows, None), mesh=mesh).global_tensor
    local_w = xs.enable_manual_sharding(_graph_node(w), (outs, None), mesh=mesh).global_tensor
    local_s = xs.enable_manual_sharding(_graph_node(scale), (outs,), mesh=mesh).global_tensor
    local = call_jax(quantized_matmul_int8, (local_x, local_w, local_s), kwargs)
    full = (x.shape[0], w.shape[0])
    return xs.disable_manual_sharding(local, (rows, outs), full, mesh=mesh).global_tensor


def _graph_node(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a node of the traced graph, never a device buffer, for a sharding annotation.

    ``mark_sharding`` (which ``enable_manual_sharding`` starts with) annotates a graph node, but
    on a tensor that is a device buffer, such as a parameter of an unrolled decoder layer, it
    re-lays out the buffer itself: through the host when the buffer is replicated (silently
    changing the model's planned layout), and not at all when it is split some other way
    ("Existing annotation must be cleared first", issue 43). A scanned stack never showed it: its
    layers' weights are slices of the stacked tensors, graph nodes already. ``clone``,
    ``detach`` and ``contiguous`` of a buffer are still the buffer to torch_xla (its IR is the
    same ``device_data``); a multiplication by one is a node of its own, which XLA's
    simplifier removes (and exact for every dtype, -0.0 included)."""
    return t * 1


def compiled_anything() -> bool:
    """Whether this process has compiled a program yet (the persistent cache must start before)."""
    torch_xla, _, _ = _xla()
    return bool(torch_xla._XLAC._xla_computation_cache_is_initialized())


def start_persistent_cache(path: str) -> None:
    """torch_xla's on-disk compilation cache in ``path``; call before anything compiles."""
    _, xr, _ = _xla()
    xr.initialize_cache(path, readonly=False)


def persistent_cache_counters() -> dict[str, int]:
    """torch_xla's PersistentCache* counters: Hit, Miss, DeserializeFailure, ..."""
    _xla()
    import torch_xla.debug.metrics as met
    return {name.removeprefix("PersistentCache"): int(met.counter_value(name) or 0)
            for name in met.counter_names() if name.startswith("PersistentCache")}


def transfers_from_device() -> int:
    """Number of device-to-host transfers so far in this process (torch_xla's metrics)."""
    return _metric_count("TransferFromDeviceTime")


class NotTraceable(RuntimeError):
    """A function read a device value while it was being traced: its graph may depend on the
    value, so the traced program cannot stand for later calls."""


class TracedPrograms:
    """Functions of device tensors traced once per input signature into an XLA computation.

    ``get(key, fn, inputs, weights)`` returns the ``Program`` for ``fn(inputs) -> outputs``
    (lists of tensors) at this (key, shapes, dtypes) signature, tracing ``fn`` through torch_xla's
    lazy tensors only the first time the signature is seen; calling the program adds its one XLA
    computation to the graph (torch_xla's user computations, as its ``assume_pure_torch``), so
    the Python inside ``fn`` runs once. ``weights`` are tensors ``fn`` reads that may change
    between calls (a model's parameters and buffers, updated in place by training): each call
    passes their current values. Any other device tensor ``fn`` reads is frozen at its value at
    trace time, so ``fn`` must read only ``inputs``, ``weights`` and constants.

    The trace runs on copies of the real inputs, not on buffer-less placeholders: reading a
    placeholder's value kills the process (SIGSEGV), while a read here is counted and refused
    (``NotTraceable``) before anything is kept. The traced outputs are dropped unrun, and
    ``fn``'s side effects on ``inputs`` (in-place updates) stay on the copies.
    """

    def __init__(self, name: str):
        self.name = "xla::autoxla_" + name
        self._programs: dict = {}

    def get(self, key, fn, inputs: list, weights: list = ()) -> "Program":
        signature = (key, _signature(inputs), _signature(weights))
        program = self._programs.get(signature)
        if program is None:
            program = self._programs[signature] = Program(self.name, fn, inputs, weights)
        return program


class Program:
    """One traced computation and where each of its parameters comes from: an input, a weight
    (both by position), or a tensor frozen at trace time."""

    def __init__(self, name: str, fn, inputs: list, weights: list):
        torch_xla, _, _ = _xla()
        from torch_xla.core.xla_builder import computation_from_module_proto

        # Every input device data, a graph leaf of its own (else its graph would be baked into
        # the program). Only the inputs: other pending tensors (a cache about to be replaced)
        # stay unrun. Waited for: lowering reads each input's buffer handle, and one still
        # being computed (a freshly allocated 38 MB cache) crashed the process (SIGSEGV in
        # PjRtShardedData::GetHandle).
        torch_xla._XLAC._xla_sync_multi(list(inputs), devices=[], wait=True)
        reads = transfers_from_device()
        outputs = list(fn([t.clone() for t in inputs]))
        if transfers_from_device() != reads:
            raise NotTraceable(f"{name} read a device value while it was traced")
        ctx = torch_xla._XLAC.lowering.LoweringContext("AutoXLAProgram")
        ctx.set_name_string(name)
        ctx.build(outputs)
        self.name = name
        self.computation = computation_from_module_proto(name, ctx.hlo())
        sources = {}
        for kind, tensors in (("input", inputs), ("weight", weights)):
            for i, t in enumerate(tensors):
                pid = ctx.tensor_parameter_id(t)
                if pid != -1:
                    sources.setdefault(pid, (kind, i))
        frozen = ctx.device_parameter_id_tensor_mapping()
        self.sources = [sources.get(pid, ("frozen", frozen[pid])) for pid in range(len(frozen))]
        self._call = torch_xla._XLAC._xla_user_computation

    def __call__(self, inputs: list, weights: list = ()) -> list:
        args = [inputs[at] if kind == "input" else weights[at] if kind == "weight" else at
                for kind, at in self.sources]
        return self._call(self.name, args, self.computation)


def _signature(tensors) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)
