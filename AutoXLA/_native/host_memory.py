"""Host memory: freed heap memory given back to the OS (glibc's ``malloc_trim``), so that
what a load step freed stops counting against the process before the next step allocates."""
from __future__ import annotations


def release_freed_host_memory() -> None:
    """Give freed heap memory back to the OS (glibc's malloc_trim). XLA:CPU's device buffers are
    host allocations made from many threads; glibc keeps what they free in per-thread arenas, so
    after the stacking of a 7B model's layers about 3 GiB of freed buffers still count as the
    process's RSS. A no-op where glibc is not the C library."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
