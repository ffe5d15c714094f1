"""The only package that talks to AutoXLA's C core (csrc/, built as `AutoXLA/_axl_core*.so`).

Python owns memory, C only computes: every function below checks its tensors (device,
layout, dtype, contiguity, shape, alignment, overlap, that the storage holds every element,
that output memory is writable: see checks._check_storage and checks._check_host_memory),
bounds what it allocates per call (shards._MAX_BLOCKS), reads regular files only, and
allocates outputs before it passes a pointer, and keeps the tensors referenced for the whole
call, so no argument can crash or hang the process. The library is loaded with ctypes at first
use, not at import; a missing or stale build raises NativeLibraryError, and a non-zero C status
raises NativeError.

One job per module, each importing only those above it:

- library      finds and loads the shared library, sets the C signatures, checks the ABI
               version (ABI_VERSION); NativeLibraryError, NativeError, _get_lib, _check_status
- cpu          cpu_features, best_isa, available_isas, num_cpus
- checks       the argument checks every kernel shares (tensors, dtypes, ints, memory the
               process can read or write per /proc/self/maps, nthreads, isa)
- convert      convert: float32 / bfloat16 / float16 in any pair
- shards       scatter_shards, read_shards, read_blocks, block_ranges, file_kind
- quant        quantize, dequantize, quantized_shape, Quantized
- safetensors  parse_safetensors_header, SafetensorsHeaderError, SafetensorsTensor
- host_memory  release_freed_host_memory: freed heap given back to the OS (libc, not the core)

Callers use the names re-exported here (`from AutoXLA import _native; _native.quantize(...)`).
A test that monkeypatches a name must patch the module that looks it up (e.g. `_native.library`
for _lib, ABI_VERSION and __file__), not this package.
"""

from __future__ import annotations

# ABI_VERSION and the private names are not in __all__ (as before the split); `autoxla doctor`
# and the tests use them.
from .library import ABI_VERSION, NativeError, NativeLibraryError, _check_status, _get_lib
from .cpu import available_isas, best_isa, cpu_features, num_cpus
from .checks import _byte_range, _range_problem, _read_mappings
from .convert import convert
from .shards import block_ranges, file_kind, read_blocks, read_shards, scatter_shards
from .quant import Quantized, dequantize, quantize, quantized_shape
from .safetensors import SafetensorsHeaderError, SafetensorsTensor, parse_safetensors_header
from .host_memory import release_freed_host_memory

__all__ = [
    "NativeError",
    "NativeLibraryError",
    "Quantized",
    "SafetensorsHeaderError",
    "SafetensorsTensor",
    "available_isas",
    "best_isa",
    "block_ranges",
    "convert",
    "cpu_features",
    "dequantize",
    "num_cpus",
    "parse_safetensors_header",
    "quantize",
    "quantized_shape",
    "read_blocks",
    "read_shards",
    "release_freed_host_memory",
    "scatter_shards",
]
