"""The C core's view of this CPU: its instruction set extensions, the ISA isa="auto" picks,
the ISAs it can run, and the CPUs this process may use."""

from __future__ import annotations

from .library import _get_lib

# axl_isa values; the vectorised ISAs are listed in increasing order of preference.
_ISAS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}

# AXL_CPU_* bits.
_CPU_FEATURE_BITS = {
    "avx2": 1 << 0,
    "f16c": 1 << 1,
    "fma": 1 << 2,
    "avx512f": 1 << 3,
    "avx512bw": 1 << 4,
    "avx512vl": 1 << 5,
    "avx512dq": 1 << 6,
    "avx512vnni": 1 << 7,
    "avx512bf16": 1 << 8,
}


def cpu_features() -> dict[str, bool]:
    """Which instruction set extensions the C core sees (and the OS enables) on this CPU."""
    bits = _get_lib().axl_cpu_features()
    return {name: bool(bits & bit) for name, bit in _CPU_FEATURE_BITS.items()}


def best_isa() -> str:
    """The ISA that isa="auto" uses here: "avx512", "avx2" or "scalar"."""
    lib = _get_lib()
    return lib.axl_isa_name(lib.axl_best_isa()).decode()


def available_isas() -> list[str]:
    """Every ISA name this CPU can run, "scalar" first (each vector ISA implies the ones
    before it)."""
    names = [name for name in _ISAS if name != "auto"]
    return names[: names.index(best_isa()) + 1]


def num_cpus() -> int:
    """CPUs this process may run on (its affinity mask); what nthreads=0 uses."""
    return _get_lib().axl_num_cpus()
