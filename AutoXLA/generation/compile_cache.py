"""torch_xla's persistent compilation cache, turned on with one option, checked before it is trusted.

``from_pretrained(..., compile_cache=DIR)``, ``autoxla generate --compile-cache DIR`` or the
environment variable ``AUTOXLA_COMPILE_CACHE=DIR`` store every compiled program in DIR, so a second
process running the same shapes reads them back instead of compiling. It must start before the
process compiles anything.

Some runtimes write the cache but cannot read it back ("Deserializing ... UNIMPLEMENTED",
pytorch/xla#9094 on TPU; on XLA:CPU every read fails too, measured with torch_xla 2.9.0). So the
first use of a directory runs a self-test: two child processes compile the same tiny program in
a scratch cache under DIR; the second must read it back. The verdict is remembered in DIR (per
torch_xla version and device type). When reading back fails the cache is left off, with a
warning in words, instead of costing disk and time for nothing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from .. import backend

ENV = "AUTOXLA_COMPILE_CACHE"
_VERDICT = "autoxla-selftest.json"
_PROBE = r"""
import json, sys, torch, torch_xla, torch_xla.runtime as xr
import torch_xla.debug.metrics as met
xr.initialize_cache(sys.argv[1], readonly=False)
x = torch.arange(7, dtype=torch.float32).to(torch_xla.device())
float(((x * 3 + 1) ** 2).sum())
print(json.dumps({n[len("PersistentCache"):]: int(met.counter_value(n) or 0)
                  for n in met.counter_names() if n.startswith("PersistentCache")}))
"""


@dataclass(frozen=True)
class CacheStatus:
    directory: str | None
    active: bool
    reason: str


_status = CacheStatus(None, False, "not requested")


def status() -> CacheStatus:
    """What this process's persistent cache is doing, and why."""
    return _status


def enable(directory=None) -> CacheStatus:
    """Turn the cache on in ``directory`` (or ``$AUTOXLA_COMPILE_CACHE``) if it reads back here.

    Idempotent for the same directory; a second, different directory or a process that has
    already compiled gets a warning and keeps what it has (torch_xla allows one cache, set first).
    """
    global _status
    directory = directory or os.environ.get(ENV) or None
    if directory is None:
        return _status
    directory = str(Path(directory).expanduser().resolve())
    if _status.directory == directory:
        return _status
    if _status.active:
        _warn(f"the compilation cache is already on in {_status.directory}; ignoring {directory} "
              "(torch_xla takes one cache per process)")
        return _status
    if backend.compiled_anything():
        _status = CacheStatus(directory, False, "the process had already compiled")
        _warn(f"compile_cache={directory} came after this process compiled its first program, so "
              "torch_xla cannot use it; pass it to the first from_pretrained of the process or set "
              f"{ENV}={directory} before starting Python")
        return _status
    Path(directory).mkdir(parents=True, exist_ok=True)
    works, detail = self_test(directory)
    if not works:
        _status = CacheStatus(directory, False, detail)
        _warn(f"torch_xla's persistent compilation cache cannot read programs back on this "
              f"runtime ({detail}), so it stays off and every process compiles from scratch "
              "(pytorch/xla#9094). Generation is unaffected; warm up the buckets instead "
              "(AutoXLA.generation.warm_up)")
        return _status
    backend.start_persistent_cache(directory)
    _status = CacheStatus(directory, True, detail)
    return _status


def self_test(directory: str) -> tuple[bool, str]:
    """(reads back?, what was seen), from two child processes; remembered in ``directory``."""
    key = _runtime_key()
    record = Path(directory) / _VERDICT
    try:
        saved = json.loads(record.read_text())
        # Any other content (another tool's file, a hand edit, valid JSON of the wrong shape) is
        # not a verdict: the self-test runs again and rewrites it.
        if (isinstance(saved, dict) and saved.get("key") == key
                and isinstance(saved.get("works"), bool) and isinstance(saved.get("detail"), str)):
            return saved["works"], saved["detail"]
    except (OSError, ValueError):
        pass
    scratch = Path(directory) / ".autoxla-selftest"
    counters = [_probe(scratch) for _ in range(2)]
    second = counters[1]
    works = second is not None and second.get("Hit", 0) > 0 and not second.get("DeserializeFailure")
    if second is None:
        detail = "the self-test process failed"
    else:
        detail = (f"{key}: second process read {second.get('Hit', 0)} program(s) back, "
                  f"{second.get('DeserializeFailure', 0)} failed to deserialize")
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "works": works, "detail": detail}))
    os.replace(tmp, record)
    return works, detail


def _probe(scratch: Path) -> dict | None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CPU_NUM_DEVICES="1")
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, str(scratch)], env=env,
                             capture_output=True, text=True, timeout=300)
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
        return None


def _runtime_key() -> str:
    from importlib.metadata import version

    return f"torch_xla {version('torch_xla')}, PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'auto')}"


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
