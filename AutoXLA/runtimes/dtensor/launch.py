"""Start one process per device on this machine, as torchrun does, and wait for them all.

What the CLI's ``--nproc`` and the tests use; torchrun itself works as well (the processes read
the same environment). A process that fails stops the others at once, so a broken rank never
leaves its peers waiting in a collective.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from .process import free_port

# How often the launcher looks at its processes, and how long the others get to stop once one
# has failed before they are killed.
_POLL_SECONDS = 0.05
_STOP_SECONDS = 5.0


def launch(nproc: int, argv: list[str], env: dict | None = None, timeout: float | None = None,
           cwd: str | None = None) -> list[int]:
    """Run ``python argv...`` in ``nproc`` processes (ranks 0..nproc-1) on loopback; their exit
    codes. Output goes to this process's stdout and stderr."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc {nproc!r}: give the number of processes, one per device (>= 1)")
    base = dict(os.environ if env is None else env)
    base.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()))
    if nproc > 1 and "OMP_NUM_THREADS" not in base:
        # As torchrun does: the processes share the machine's cores. With PyTorch's default (a
        # thread per core in every process) 8 ranks on 2 cores spent their time in threads
        # spinning against each other: the dtensor matrix's generation took 76 s per model
        # instead of 20 (tests/dtensor/test_matrix.py, this 2-core machine).
        base["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    procs = []
    for rank in range(nproc):
        procs.append(subprocess.Popen([sys.executable, *argv], cwd=cwd,
                                      env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank))))
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            late = deadline is not None and time.monotonic() > deadline
            if failed or late:
                _stop(procs)
                break
            time.sleep(_POLL_SECONDS)
    except BaseException:
        _stop(procs)
        raise
    return [p.returncode for p in procs]


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + _STOP_SECONDS
    for p in procs:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
