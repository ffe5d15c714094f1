"""Training checkpoints: model and optimizer state saved sharded, one directory per step, each step
committed atomically, restorable onto the same or another mesh, exportable as safetensors.

The shards are written and read by torch.distributed.checkpoint (DCP) with torch_xla's SPMD
planners: every process writes the shards its devices hold (one copy of each replicated shard in
all), and a restore reads, for every tensor of the model as it is now sharded, the pieces its
devices need, whatever mesh saved them. AutoXLA adds what DCP leaves to the caller:

* **One step, one commit.** A step is written into ``step-00000004.partial/``; only when DCP has
  finished does process 0 write ``autoxla-train.json`` (the manifest: step, names, shapes, the
  optimizer's settings, the model's config) into it and rename the directory to
  ``step-00000004/``. A rename is atomic, so a save killed at any point leaves the previous steps
  as they were and at most a ``.partial`` directory, which ``steps()`` ignores and the next save
  removes. Re-saving a step that exists moves the old one aside (``.replaced``) until the new one
  is in place; ``steps()`` puts it back if a kill came in between.
* **One writer per directory.** The first ``save`` takes an exclusive lock on
  ``.autoxla-train.lock`` in the directory (``flock``; the OS drops it when the process ends, even
  killed) and keeps it until ``close()``: a second process or object saving into the directory
  gets a TrainingCheckpointError and never touches the first one's work. Repairs of what a killed
  save left happen only under the lock.
* **Checked before trusted.** A step is committed only when every file DCP's metadata names is
  there with its bytes; ``steps()`` lists a step only when its manifest reads back, and
  ``restore`` checks the manifest, the metadata and every file's size before it touches the model
  or the optimizer, so a damaged step leaves both as they were. Every failure is a
  TrainingCheckpointError naming the step and the file. Anything else in the directory is
  ignored, with a warning.
* **Names, not positions.** Optimizer state is stored under its parameter's name, so it follows
  the parameter to another mesh, another optimizer instance, or a model built again.
* **Export.** ``export_safetensors`` writes the model of a step as a normal checkpoint directory
  (config.json + safetensors, per-layer names even for a scanned stack) with save_pretrained's
  journaled, atomic writer, one group of tensors in memory at a time.

Over 600 lines because the commit protocol, the checks and the export are one contract with one
lock; split, each part would have to re-establish it.

On several processes, ``torch.distributed`` must be initialised (``gloo``, docs/multihost.md); the
directory must be shared storage all hosts see. On one process nothing needs initialising.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import warnings
from pathlib import Path

import torch
from torch import nn

from .. import backend
from ..planning.plan import persistent_buffer_names
from . import journal
from .journal import _write_text
from .journal import _fsync_dir as fsync_dir
from .pretrained import _FSDP_WRAPPED, config_json, generation_json, unwrap
from .safetensors_out import ShardWriter

MANIFEST = "autoxla-train.json"
FORMAT = 1
LOCK = ".autoxla-train.lock"
_NAME = re.compile(r"^step-(\d{8,})(\.partial|\.replaced)?$")


class TrainingCheckpointError(ValueError):
    """A training checkpoint that cannot be saved or restored as asked; the message says why."""


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _parse(entry: str) -> tuple[int, str] | None:
    """(step, "" | ".partial" | ".replaced") for a name ``_step_name`` writes (any number of
    digits, no other spelling of the same step), else None."""
    m = _NAME.match(entry)
    if not m or entry != _step_name(int(m.group(1))) + (m.group(2) or ""):
        return None
    return int(m.group(1)), m.group(2) or ""


class TrainingCheckpoints:
    """Training checkpoints under ``directory``: ``save(step, model, optimizer)`` after a step,
    ``restore(model, optimizer)`` to go on from the latest one (or ``step=``), ``keep`` the newest
    steps only (None: all). ``trainable_only``: the parameters that train (and their optimizer
    state), not the frozen rest: a LoRA run's commits hold its adapters, not the base model."""

    def __init__(self, directory: str | os.PathLike, keep: int | None = None,
                 trainable_only: bool = False):
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise TrainingCheckpointError(f"{self.directory} is a file; training checkpoints need "
                                          "a directory: pass another path")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise TrainingCheckpointError(f"keep={keep!r}: keep at least 1 step, or None for all")
        self.keep, self.trainable_only = keep, trainable_only
        self._lock = None        # the open lock file while this object is the directory's writer
        self._warned: set[str] = set()

    def close(self) -> None:
        """Give up the directory's writer lock (another process may then save into it)."""
        lock = getattr(self, "_lock", None)      # None too when __init__ raised
        if lock is not None:
            lock.close()             # closing the descriptor releases the flock
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    # -- what is there ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The committed steps, ascending (a step whose save was killed is not one, nor a step
        whose manifest does not read back: that one is named in a warning)."""
        if not self.directory.is_dir():
            return []
        if _rank() == 0:            # one process repairs, under the lock; the others only look
            with self._locked_if_free() as locked:
                if locked:
                    self._settle_replaced()
        found = []
        for entry in sorted(os.listdir(self.directory)):
            parsed = _parse(entry)
            if parsed is None or not (self.directory / entry).is_dir():
                if entry != LOCK:
                    self._warn_once(entry, f"{self.directory / entry} is not a training checkpoint "
                                    "step; ignored (move it out of the directory to silence this)")
                continue
            step, suffix = parsed
            if suffix or not (self.directory / entry / MANIFEST).is_file():
                continue            # a save under way or killed: not a step
            try:
                _read_manifest(self.directory / entry, step)
            except TrainingCheckpointError as e:
                self._warn_once(entry, f"{e}; the step is skipped")
                continue
            found.append(step)
        return sorted(found)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        return self.directory / _step_name(step)

    # -- save ------------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
             ) -> Path:
        """Writes model (and optimizer) state as ``step``; returns the step's directory once it is
        committed. Call it after the optimizer step, on every process."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TrainingCheckpointError(f"step={step!r}: pass the training step as an int >= 0")
        model = _unwrap(model)
        params = _named_state(model, self.trainable_only)
        state = {"model": params}
        manifest = {"format": FORMAT, "step": step, "model": _describe(params),
                    "stacked": _stacked_names(model), "saved_by": _saved_by(params),
                    **_model_files(model)}
        if optimizer is not None:
            state["optimizer"], manifest["optimizer"] = _optimizer_state(model, optimizer)
        if any(_on_xla(t) for t in _leaves(state)):
            backend.sync()
            backend.wait_for_transfers()
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / (_step_name(step) + ".partial")
        _leader_decides(self._prepare_to_write)
        _barrier()
        _run_dcp("save", state, partial, f"saving step {step} into {partial} failed")
        _barrier()
        _leader_decides(lambda: self._commit(partial, step, manifest))
        _barrier()
        return self.path(step)

    def _prepare_to_write(self) -> None:
        """On process 0: the lock first, then what killed saves left (only the writer clears)."""
        self._become_writer()
        self._remove_partials()

    def _become_writer(self) -> None:
        """Take the directory's lock, or a TrainingCheckpointError naming who holds it."""
        if self._lock is not None:
            return
        lock = open(self.directory / LOCK, "a+")
        if not _flock_now(lock):
            holder = _holder(lock)
            lock.close()
            raise TrainingCheckpointError(
                f"{self.directory} is being written by {holder}: a training-checkpoint directory "
                "takes one writer at a time, and a second would corrupt the first's steps. Save "
                "into another directory, or stop the other run (or close() its "
                "TrainingCheckpoints) first") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        lock.flush()
        self._lock = lock

    @contextlib.contextmanager
    def _locked_if_free(self):
        """True inside when this object holds the lock or could take it for the moment."""
        if self._lock is not None:
            yield True
            return
        try:
            lock = open(self.directory / LOCK, "a+")
        except OSError:            # a read-only directory: look, never repair
            yield False
            return
        with lock:
            yield _flock_now(lock)

    def _commit(self, partial: Path, step: int, manifest: dict) -> None:
        problem = _missing_data(partial)
        if problem:
            raise TrainingCheckpointError(f"step {step} was not committed: {problem} (in "
                                          f"{partial}); the previous steps are untouched")
        _write_json(partial / MANIFEST, manifest)
        _fsync_dir(partial)
        final = self.path(step)
        aside = self.directory / (_step_name(step) + ".replaced")
        if final.exists():
            os.rename(final, aside)
        os.rename(partial, final)             # the commit point
        _fsync_dir(self.directory)
        if aside.exists():
            shutil.rmtree(aside)
        if self.keep is not None:
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(self.path(old))

    def _remove_partials(self) -> None:
        """What killed saves left: ``.partial`` directories (never committed; only the writer,
        holding the lock, calls this, so none is another process's save under way)."""
        for entry in os.listdir(self.directory):
            parsed = _parse(entry)
            if parsed and parsed[1] == ".partial" and (self.directory / entry).is_dir():
                shutil.rmtree(self.directory / entry)

    def _settle_replaced(self) -> None:
        """A re-save killed between moving the old step aside and renaming the new one in: the
        old one is put back; one killed after: the old one is removed."""
        for entry in os.listdir(self.directory):
            parsed = _parse(entry)
            if not parsed or parsed[1] != ".replaced" or not (self.directory / entry).is_dir():
                continue
            final = self.path(parsed[0])
            if final.exists():
                shutil.rmtree(self.directory / entry)
            else:
                os.rename(self.directory / entry, final)

    # -- restore ---------------------------------------------------------------------------------
    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                step: int | None = None) -> int:
        """Loads ``step`` (default: the latest) into ``model`` (and ``optimizer``) in place, each
        tensor resharded onto the model's mesh as it is now; returns the step. The model must be
        the one that was saved, loaded the same way (same names and shapes, any mesh)."""
        step, path, manifest = self._committed(step)
        model = _unwrap(model)
        params = _named_state(model, self.trainable_only)
        _check_same(manifest["model"], _describe(params), path)
        state = {"model": params}
        if optimizer is not None:
            saved = manifest.get("optimizer")
            if saved is None:
                raise TrainingCheckpointError(f"{path} holds no optimizer state (saved without "
                                              "one); restore the model only, optimizer=None")
            _check_optimizer(model, optimizer, saved, path)
            state["optimizer"] = _optimizer_templates(model, saved)
        # Everything DCP is about to read is there, whole: checked before the first byte lands in
        # the model, so a damaged step leaves the model and the optimizer as they were.
        problem = _missing_data(path, state)
        gap = _version_gap(manifest)
        if problem and gap:        # what a newer torch's metadata looks like to an older one
            raise TrainingCheckpointError(f"step {step} cannot be read here: {problem} (in "
                                          f"{path}); {gap}. The model and optimizer are untouched")
        if problem:
            others = [s for s in self.steps() if s != step]
            raise TrainingCheckpointError(f"step {step} is damaged: {problem} (in {path}); the "
                                          "model and optimizer are untouched. Restore another "
                                          f"step (restore(..., step=N); committed: {others})")
        _run_dcp("load", state, path, f"reading step {step} from {path} failed",
                 f"{'; ' + gap if gap else ''}; the model may hold part of it: restore again "
                 "(another step) before training on")
        if optimizer is not None:
            _load_optimizer(model, optimizer, manifest["optimizer"], state["optimizer"])
        return step

    def _committed(self, step: int | None) -> tuple[int, Path, dict]:
        """(step, its directory, its checked manifest): the latest when ``step`` is None."""
        steps = self.steps()
        if step is None:
            if not steps:
                raise TrainingCheckpointError(f"no committed training checkpoint in "
                                              f"{self.directory}; save one first")
            step = steps[-1]
        elif step not in steps:
            if (self.path(step) / MANIFEST).is_file():
                _read_manifest(self.path(step), step)      # raises what is wrong with it
            raise TrainingCheckpointError(f"step {step} is not a committed checkpoint in "
                                          f"{self.directory} (committed: {steps or 'none'})")
        path = self.path(step)
        return step, path, _read_manifest(path, step)

    # -- export ----------------------------------------------------------------------------------
    def export_safetensors(self, out_dir: str | os.PathLike, step: int | None = None,
                           max_shard_size: int | str = "5GB") -> Path:
        """The model of ``step`` (default: the latest) as a checkpoint directory from_pretrained
        and transformers load: config.json, safetensors (per-layer names), index. Written with
        save_pretrained's journaled writer: a failure leaves ``out_dir`` as it was."""
        import torch.distributed.checkpoint as dcp

        step, path, manifest = self._committed(step)
        problem = _missing_data(path)
        if problem:
            raise TrainingCheckpointError(f"step {step} is damaged: {problem} (in {path}); "
                                          "nothing was exported")
        if manifest.get("config") is None:
            raise TrainingCheckpointError(f"{path} was saved from a model without a transformers "
                                          "config, so it cannot be exported as a checkpoint")
        described = manifest["model"]
        names = _export_names(described, manifest["stacked"])
        sizes = {n: _nbytes(*_export_spec(n, described, names)) for n in names}
        groups = journal.shard_groups(sizes, journal.parse_size(max_shard_size))
        target = Path(out_dir)
        target.mkdir(parents=True, exist_ok=True)

        def write_shards(paths, groups):
            for file, group in zip(paths, groups):
                specs = {n: _export_spec(n, described, names) for n in group}
                sources = sorted({names[n][0] for n in group})
                held = {s: torch.empty(described[s]["shape"], dtype=_dtype(described[s]["dtype"]))
                        for s in sources}
                with _quiet_single_process():
                    dcp.load({"model": held}, storage_reader=dcp.FileSystemReader(str(path)))
                writer = ShardWriter(specs, [group], [file])
                try:
                    for n in group:
                        source, layer = names[n]
                        writer.write(n, held[source] if layer is None else held[source][layer])
                finally:
                    writer.close()
                del held

        journal.write_checkpoint(target, groups, write_shards, manifest["config"],
                                manifest.get("generation_config"))
        return target


# -- state ---------------------------------------------------------------------------------------
def _unwrap(model: nn.Module) -> nn.Module:
    return unwrap(model)


def _named_state(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by the model's own names (FSDPv2's wrapper names
    dropped), each storage once: the names a model loaded the same way has on any mesh; only
    the parameters that train with ``trainable_only``."""
    named = list(model.named_parameters())
    if trainable_only:
        named = [(n, p) for n, p in named if p.requires_grad]
    else:
        persistent = persistent_buffer_names(model)
        named += [(n, b) for n, b in model.named_buffers() if n in persistent]
    return {_checkpoint_name(n): t for n, t in named if t is not None}


def _checkpoint_name(name: str) -> str:
    """A parameter's name as checkpoints record it: FSDPv2's wrapper parts dropped, and a scanned
    stack's tensor (held as ``stacked.self_attn/q_proj/weight``) dotted, as checkpoints written
    before the stack held its tensors flat name it."""
    return name.replace(_FSDP_WRAPPED, "").replace("/", ".")


def _describe(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    return {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for n, t in tensors.items()}


def _version_gap(manifest: dict) -> str:
    """The torch versions apart, when the step was saved by another one ("" when not)."""
    saved = manifest.get("saved_by") or {}
    here = torch.__version__.split("+")[0]
    if not saved.get("torch") or saved["torch"] == here:
        return ""
    return (f"it was saved by torch {saved['torch']} on the {saved.get('runtime')} runtime and "
            f"this is torch {here}, whose torch.distributed.checkpoint may not read another "
            "version's files. Restore it where it was saved, or export_safetensors() there and "
            "load that checkpoint here (docs/runtimes.md)")


def _check_same(saved: dict, now: dict, path: Path) -> None:
    missing = sorted(set(saved) - set(now))
    extra = sorted(set(now) - set(saved))
    changed = sorted(n for n in set(saved) & set(now) if saved[n] != now[n])
    if missing or extra or changed:
        what = "; ".join(part for part in (
            f"the checkpoint has {missing[:3]} the model lacks" if missing else "",
            f"the model has {extra[:3]} the checkpoint lacks" if extra else "",
            f"{changed[0]} is {saved[changed[0]]} in the checkpoint but {now[changed[0]]} in the "
            "model" if changed else "") if part)
        hint = ""
        if any(".stacked." in n for n in missing) and not any(".stacked." in n for n in now):
            hint = (" It was saved from a scanned decoder stack (scan_layers=True) and the model "
                    "is not scanned: the dtensor runtime runs unscanned, so to move training "
                    "between runtimes load with scan_layers=False on the xla runtime.")
        elif any(".stacked." in n for n in extra) and not any(".stacked." in n for n in saved):
            hint = (" The model is scanned (scan_layers=True) and the checkpoint was not: load "
                    "with scan_layers=False.")
        raise TrainingCheckpointError(
            f"{path} was saved from a different model: {what}. Restore into the model loaded the "
            "same way (same checkpoint, quantization and scan_layers; the mesh and the runtime "
            f"may differ).{hint}")


def _stacked_names(model: nn.Module) -> dict[str, list[str]]:
    """A scanned stack's ``[layers, ...]`` tensor -> the per-layer names transformers uses."""
    out = {}
    for prefix, m in model.named_modules():
        if not hasattr(m, "per_layer_items"):     # modeling/scan.py's StackedDecoderLayers
            continue
        prefix = (prefix + ".").replace(_FSDP_WRAPPED, "").rstrip(".")
        for name, key in m.stacked_keys().items():
            out[_checkpoint_name(f"{prefix}.stacked.{key}")] = [f"{prefix}.{i}.{name}"
                                                                 for i in m.scanned_layers]
    return out


def _model_files(model: nn.Module) -> dict:
    if getattr(model, "config", None) is None:      # a plain nn.Module: nothing to export with
        return {"config": None, "generation_config": None}
    return {"config": config_json(model), "generation_config": generation_json(model)}


def _optimizer_state(model: nn.Module, optimizer) -> tuple[dict, dict]:
    """(parameter name -> its state tensors, the manifest's optimizer entry: class, settings per
    group by parameter name, and what each state tensor is)."""
    names = _param_names(model)
    sd = optimizer.state_dict()
    order = [p for g in optimizer.param_groups for p in g["params"]]
    state, described, scalars = {}, {}, {}
    for index, entry in sd["state"].items():
        name = names.get(id(order[index]))
        if name is None:
            raise TrainingCheckpointError(
                "the optimizer holds a parameter that is not the model's; pass the optimizer "
                "built over model.parameters()")
        state[name] = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor)}
        described[name] = {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."),
                               "xla": _on_xla(v), "dtensor": _is_dtensor(v)}
                           for k, v in state[name].items()}
        scalars[name] = {k: v for k, v in entry.items() if not isinstance(v, torch.Tensor)}
    groups = []
    for g, saved in zip(optimizer.param_groups, sd["param_groups"]):
        settings = {k: v for k, v in saved.items() if k != "params"}
        groups.append({"settings": settings, "params": [names.get(id(p)) for p in g["params"]]})
    return state, {"class": type(optimizer).__name__, "groups": groups, "state": described,
                   "scalars": scalars}


def _optimizer_templates(model: nn.Module, saved: dict) -> dict:
    """Tensors DCP loads the optimizer state into: XLA ones sharded like their parameter."""
    params = {name: p for p, name in _parameters_by_name(model)}
    out = {}
    for name, entries in saved["state"].items():
        if name not in params:
            raise TrainingCheckpointError(f"the optimizer state names parameter {name!r}, which "
                                          "the model does not have: restore into the same model")
        p = params[name]
        out[name] = {}
        for key, d in entries.items():
            dtype = _dtype(d["dtype"])
            # Laid out like its parameter when saved (sharded on XLA devices, or a DTensor): laid
            # out like it now, on whichever runtime the model runs (DCP reshards into it)
            like = (d["xla"] or d.get("dtensor", False)) and list(p.shape) == d["shape"]
            if like:
                t = torch.zeros_like(p, dtype=dtype)
                if _on_xla(p):
                    backend.shard_like(t, p)
            elif d["xla"] and _on_xla(p):
                t = torch.zeros(d["shape"], dtype=dtype, device=p.device)
            else:
                t = torch.zeros(d["shape"], dtype=dtype)
            out[name][key] = t
    if any(_on_xla(t) for t in _leaves(out)):
        backend.sync()
    return out


def _check_optimizer(model: nn.Module, optimizer, saved: dict, path: Path) -> None:
    """The optimizer is the one the step was saved from (class, groups, their parameters):
    checked before anything is loaded."""
    names = _param_names(model)
    if saved["class"] != type(optimizer).__name__:
        raise TrainingCheckpointError(f"{path}: the optimizer state is {saved['class']}'s, not "
                                      f"{type(optimizer).__name__}'s: build the same optimizer")
    if len(saved["groups"]) != len(optimizer.param_groups):
        raise TrainingCheckpointError(f"{path} has {len(saved['groups'])} parameter group(s), the "
                                      f"optimizer {len(optimizer.param_groups)}")
    for g, s in zip(optimizer.param_groups, saved["groups"]):
        if [names.get(id(p)) for p in g["params"]] != s["params"]:
            raise TrainingCheckpointError(f"{path}: the optimizer's parameter groups hold other "
                                          "parameters than the checkpoint's; build it the same way")


def _load_optimizer(model: nn.Module, optimizer, saved: dict, loaded: dict) -> None:
    names = _param_names(model)
    order = [p for g in optimizer.param_groups for p in g["params"]]
    index = {names.get(id(p)): i for i, p in enumerate(order)}
    groups = [{**s["settings"], "params": [index[n] for n in s["params"]]}
              for s in saved["groups"]]
    # In the optimizer's parameter order, as its own state dict lists them (the manifest's JSON
    # sorts names).
    state = {index[n]: {**loaded[n], **saved["scalars"].get(n, {})}
             for n in sorted(loaded, key=index.__getitem__)}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for p, name in _parameters_by_name(model)}


def _parameters_by_name(model: nn.Module) -> list[tuple[nn.Parameter, str]]:
    """(parameter, its name without FSDPv2's wrapper parts), as named_parameters lists them."""
    return [(p, _checkpoint_name(n)) for n, p in model.named_parameters()]


# -- export --------------------------------------------------------------------------------------
def _export_names(described: dict, stacked: dict) -> dict[str, tuple[str, int | None]]:
    """Exported name -> (checkpoint tensor, layer index into it or None), in checkpoint order."""
    out = {}
    for name in described:
        if name in stacked:
            out.update({per: (name, i) for i, per in enumerate(stacked[name])})
        else:
            out[name] = (name, None)
    return out


def _export_spec(name: str, described: dict, names: dict) -> tuple[tuple[int, ...], torch.dtype]:
    source, layer = names[name]
    shape = described[source]["shape"]
    return tuple(shape[1:] if layer is not None else shape), _dtype(described[source]["dtype"])


def _nbytes(shape, dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# -- plumbing ------------------------------------------------------------------------------------
def _leaves(state):
    if isinstance(state, dict):
        for v in state.values():
            yield from _leaves(v)
    elif isinstance(state, torch.Tensor):
        yield state


def _on_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _saved_by(tensors: dict[str, torch.Tensor]) -> dict:
    """Which runtime and torch wrote a step: named when another one cannot read it."""
    leaves = list(tensors.values())
    runtime = ("xla" if any(_on_xla(t) for t in leaves) else
               "dtensor" if any(_is_dtensor(t) for t in leaves) else "cpu")
    return {"runtime": runtime, "torch": torch.__version__.split("+")[0]}


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns at every save and load that torch.distributed is not initialised; on one process
    that is the intended setup (module docstring), not news."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _run_dcp(kind: str, state: dict, path: Path, failed: str, advice: str = "") -> None:
    """DCP's save or load of ``state`` at ``path``; its failures (a CheckpointException is a
    BaseException carrying every rank's traceback) as one TrainingCheckpointError line:
    ``failed``, DCP's own words, ``advice``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_single_process():
            if kind == "save":
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)),
                         planner=_planner(kind, state))
            else:
                dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)),
                         planner=_planner(kind, state))
    except (Exception, CheckpointException) as e:
        raise TrainingCheckpointError(f"{failed}: {_first_line(e)}{advice}") from None


def _planner(kind: str, state: dict):
    """torch_xla's SPMD planners for XLA tensors (each process writes and reads its own shards);
    DCP's defaults for a state on the CPU, which needs no torch_xla."""
    if not any(_on_xla(t) for t in _leaves(state)):
        return None
    import torch_xla.experimental.distributed_checkpoint as xc

    return xc.SPMDSavePlanner() if kind == "save" else xc.SPMDLoadPlanner()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    _write_text(tmp, json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fsync_dir(path)


# -- checks --------------------------------------------------------------------------------------
def _read_manifest(path: Path, step: int) -> dict:
    """The step's manifest, checked for the shape restore and export read (a hand-edited,
    truncated or foreign file is named, not met later as a KeyError)."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TrainingCheckpointError(f"step {step}: {file} cannot be read ({_first_line(e)})") \
            from None

    def bad(what: str):
        return TrainingCheckpointError(f"step {step}: {file} is not an AutoXLA training manifest "
                                       f"({what})")

    if not isinstance(manifest, dict):
        raise bad(f"a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT:
        raise bad(f"format {manifest.get('format')!r}, this AutoXLA reads {FORMAT}")
    if manifest.get("step") != step:
        raise bad(f"it says step {manifest.get('step')!r}")
    tensors = manifest.get("model")
    if not isinstance(tensors, dict) or not all(_is_tensor_entry(v) for v in tensors.values()):
        raise bad("its model entry is not a table of shapes and dtypes")
    stacked = manifest.get("stacked")
    if not isinstance(stacked, dict) or not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in stacked.values()):
        raise bad("its stacked entry is not a table of layer names")
    opt = manifest.get("optimizer")
    if opt is not None and not (
            isinstance(opt, dict) and isinstance(opt.get("class"), str)
            and isinstance(opt.get("groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("settings"), dict)
                    and isinstance(g.get("params"), list) for g in opt["groups"])
            and isinstance(opt.get("state"), dict)
            and all(isinstance(e, dict) and all(_is_tensor_entry(d) and isinstance(d.get("xla"), bool)
                                                for d in e.values())
                    for e in opt["state"].values())
            and isinstance(opt.get("scalars"), dict)):
        raise bad("its optimizer entry is malformed")
    return manifest


def _is_tensor_entry(d) -> bool:
    return (isinstance(d, dict) and isinstance(d.get("shape"), list)
            and all(isinstance(n, int) and n >= 0 for n in d["shape"])
            and isinstance(d.get("dtype"), str)
            and isinstance(getattr(torch, d["dtype"], None), torch.dtype))


def _missing_data(path: Path, state: dict | None = None) -> str | None:
    """What of a step's data is not there (None: all of it): DCP's ``.metadata``, every file it
    names with at least the bytes it names, and each tensor of ``state`` in it."""
    import torch.distributed.checkpoint as dcp

    if not (path / ".metadata").is_file():
        return ".metadata is missing"
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                           info.offset + info.length)
    except Exception as e:         # noqa: BLE001 - unpickling a damaged file raises anything
        return f".metadata cannot be read ({_first_line(e)})"
    for name, end in sorted(ends.items()):
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size < end:
            return f"{name} is truncated ({size} bytes, the metadata needs {end})"
    if state is not None:
        missing = [k for k in _flat_keys(state) if k not in metadata.state_dict_metadata]
        if missing:
            return f".metadata does not list {missing[:3]}"
    return None


def _flat_keys(state: dict, prefix: str = ""):
    """DCP's names for the leaves of a nested state: the keys joined by dots."""
    for k, v in state.items():
        if isinstance(v, dict):
            yield from _flat_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def _first_line(e: BaseException) -> str:
    """An exception in one line: DCP's CheckpointException carries each rank's whole traceback."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if type(e).__name__ == "CheckpointException":
        # "...: {rank: (ExcType('message'), traceback)}": the innermost message says what happened
        for line in reversed(lines):
            if "Error" in line or "Exception" in line:
                return line[:300]
    return (lines[0] if lines else type(e).__name__)[:300]


def _holder(lock) -> str:
    """Who holds ``lock``: the line it writes just after taking it (read again for up to half a
    second, since a refused writer can look between the two)."""
    import time

    for _ in range(10):
        lock.seek(0)
        holder = lock.read().strip()
        if holder:
            return holder
        time.sleep(0.05)
    return "another process"


def _flock_now(lock) -> bool:
    """An exclusive flock on the open file ``lock`` if nobody holds one: True when taken."""
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _leader_decides(fn) -> None:
    """Run ``fn`` on process 0 and raise its TrainingCheckpointError on every process (raised on
    process 0 alone, the others would wait at the next barrier for ever)."""
    message = None
    if _rank() == 0:
        try:
            fn()
        except TrainingCheckpointError as e:
            message = str(e)
    message = _broadcast(message)
    if message:
        raise TrainingCheckpointError(message)


def _broadcast(value):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
