"""The TPU kernels off a TPU: Pallas interpret mode inside the sharded torch_xla graph.

The one module that reaches into torch_xla's and JAX's internals for emulation (tests, ``autoxla
doctor --selftest`` on a machine without a TPU). After ``enable()``, every Pallas call AutoXLA
makes runs the real kernel code, interpreted: JAX lowers a Pallas TPU kernel in interpret mode to
plain HLO loops, which XLA:CPU runs, and torch_xla splices that HLO into its lazy graph.

What it changes, process-wide and for good (TORCH_XLA_NOTES.md section 7):
- JAX: as many CPU devices as torch_xla has (the splash wrapper runs a JAX ``shard_map`` over
  the mesh), and the private flag ``pallas_tpu_interpret_mode_context_manager`` set globally (the
  TPU kernels take no ``interpret`` argument; autograd runs the backward on another thread, so a
  thread-local setting would miss it).
- torch_xla's flash wrapper: ``trace_pallas`` (which extracts a Mosaic payload that only a TPU
  can run) and ``_xla_tpu_custom_call`` (which puts that payload in the graph) are replaced by a
  pair that records the kernel and calls it through ``call_jax`` instead. The wrapper's own
  padding, segment-id layouts and manual sharding (``_shard_map``) run unchanged.
- ``backend.runs_pallas()`` answers True, so AutoXLA's call sites take their TPU branch.
The splash wrapper and the quantized matmul already go through ``call_jax`` and need nothing.

Importing jax makes torchax importable, which renames torch's PrivateUse1 backend and makes
``mark_sharding`` import both on first use: keep this out of processes that test anything else.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch

from .. import backend

PINNED = {"jax": "0.7.1", "jaxlib": "0.7.1"}   # what torch_xla 2.9.0's `pallas` extra pins


# What a user runs to get the emulated kernels: the JAX stack torch_xla 2.9's `pallas` extra pins,
# and torchax (the copy inside the torch_xla wheel imports flax). pyproject.toml's `emulation`
# extra and requirements-tpu-emulation.lock list the same.
INSTALL = (f"pip install 'jax=={PINNED['jax']}' 'jaxlib=={PINNED['jaxlib']}' 'torchax==0.0.7' "
           "(or pip install 'autoxla[emulation]'); from a checkout, `./run emulated -m "
           "AutoXLA.cli doctor --selftest` runs with them without installing anything")


class EmulationUnavailable(ImportError):
    """The emulated TPU kernels need JAX, an optional dependency this environment lacks: a user's
    installation to complete, not a bug (the command reports it as a user error)."""


def missing() -> str | None:
    """Why emulation cannot run in this environment (with how to fix it), or None."""
    for name in ("jax", "jaxlib"):
        if importlib.util.find_spec(name) is None:
            return (f"{name} is not installed, and off a TPU the Pallas kernels run emulated, "
                    f"which needs JAX: {INSTALL}")
    return None


def enabled() -> bool:
    return backend.emulating_tpu_kernels()


def enable() -> None:
    """Switches this process to the emulated TPU kernels; idempotent. Call after torch_xla has
    its devices (``backend.ensure_spmd()``) and before anything imports jax."""
    if backend.emulating_tpu_kernels():
        return
    why = missing()
    if why:
        raise EmulationUnavailable(why)

    if backend.on_tpu():
        raise RuntimeError("this process runs on a TPU: the real kernels run, not their emulation")
    backend.ensure_spmd()
    devices = backend.device_count()
    # torch_xla grabs its devices before JAX may start its backend (jax_import_guard).
    import torch_xla
    torch_xla._XLAC._init_computation_client()
    import jax
    from jax._src import config as jax_config

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    if jax.device_count() != devices:   # JAX's backend had started before, with other devices
        raise RuntimeError(f"JAX runs {jax.device_count()} CPU devices; the emulated kernels "
                           f"need {devices}, one per XLA device: enable() before using JAX")
    jax_config.pallas_tpu_interpret_mode_context_manager.set_global(True)

    import torch_xla.experimental.custom_kernel as custom_kernel
    custom_kernel.trace_pallas = _trace_pallas
    torch_xla._XLAC._xla_tpu_custom_call = _tpu_custom_call
    backend.record_emulated_tpu_kernels()


@dataclasses.dataclass(frozen=True)
class _Recorded:
    """What ``trace_pallas`` was given, in place of the Mosaic payload it would return."""

    kernel: object
    template: tuple        # the positional arguments, each tensor replaced by its shape
    kwargs: tuple          # sorted (name, value) pairs, all static

    @property
    def key(self):
        return ("autoxla-interpreted", self)


@dataclasses.dataclass(frozen=True)
class _TensorSlot:
    shape: tuple


def _trace_pallas(kernel, *args, static_argnums=None, static_argnames=None, use_cache=False,
                  **kwargs):
    from jax.experimental.pallas.ops.tpu.flash_attention import SegmentIds

    def slot(a):
        if torch.is_tensor(a):
            return _TensorSlot(tuple(a.shape))
        if isinstance(a, SegmentIds):
            return SegmentIds(_TensorSlot(tuple(a.q.shape)), _TensorSlot(tuple(a.kv.shape)))
        return a

    template = tuple(slot(a) for a in args)
    tensors = [a for a in args if torch.is_tensor(a)]
    # Non-tensor arguments stay Python values in the template: static to the kernel, as the
    # static_argnums/static_argnames torch_xla names.
    return _Recorded(kernel, template, tuple(sorted(kwargs.items()))), tensors


def _narrow(operand, shape: tuple, axis: int):
    """The custom call's operands carry broadcast copies of some kernel arguments (torch_xla
    repeats segment ids and the softmax residuals over TPU lanes, or kv segment ids over
    sublanes, axis 1): undo the broadcast along ``axis``."""
    if tuple(operand.shape) == shape:
        return operand
    import jax.lax as lax

    narrowed = lax.index_in_dim(operand, 0, axis, keepdims=False)
    if tuple(narrowed.shape) != shape:
        raise ValueError(f"interpreted Pallas call: operand {operand.shape} does not fit {shape}")
    return narrowed


def _tpu_custom_call(operands, payload, shapes, dtypes):
    if not isinstance(payload, _Recorded):
        raise RuntimeError("a Mosaic payload reached the emulated custom call: a Pallas kernel "
                           "was traced for a TPU outside kernels/interpret.py's replacement")
    from torch_xla.core.xla_builder import call_jax

    run = functools.partial(_run_recorded, payload, tuple(tuple(s) for s in shapes))
    out = call_jax(run, tuple(operands), name="autoxla_interpreted_pallas",
                   override_hash=(payload.key, tuple(tuple(s) for s in shapes)))
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _run_recorded(payload: _Recorded, shapes: tuple, *operands):
    """The recorded kernel on the custom call's operands, its outputs shaped as the call's."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.flash_attention import SegmentIds

    ops = list(operands)
    args = []
    for item in payload.template:
        if isinstance(item, _TensorSlot):
            args.append(_narrow(ops.pop(0), item.shape, -1))
        elif isinstance(item, SegmentIds):
            args.append(SegmentIds(_narrow(ops.pop(0), item.q.shape, -1),
                                   _narrow(ops.pop(0), item.kv.shape, 1)))
        else:
            args.append(item)
    if ops:
        raise ValueError(f"interpreted Pallas call: {len(ops)} operands left over")
    outs = payload.kernel(*args, **dict(payload.kwargs))
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if o is not None]
    fitted = []
    for out, shape in zip(outs, shapes):
        if tuple(out.shape) != shape:     # residuals the custom call returns lane-broadcast
            out = jnp.broadcast_to(jnp.expand_dims(out, -1), shape)
        fitted.append(out)
    return tuple(fitted) if len(fitted) > 1 else fitted[0]

