"""Which tiles torch_xla's Pallas int8 matmul kernel runs with, read from torch_xla's own table.

torch_xla tuned its kernel (``pallas_kernels/quantized_matmul_kernel.py``, ``TUNED_BLOCK_SIZES``)
for a list of (TPU generation, tokens, out features, in features, activation dtype, int8
activations) and, on a miss, its op silently runs XLA's quantized matmul instead. AutoXLA decides
this when it plans, by layer shape, so the plan says what runs; then it calls the kernel itself
with the chosen tiles, so nothing falls back behind the plan's back:
- on a TPU generation whose table has the layer's (out, in), the Pallas backend runs with the
  tiles of the nearest tuned token count (the smallest at or above the call's tokens, else the
  largest);
- on a TPU generation without them, the layer takes the next backend (the quantizer says so);
- in the emulated mode (kernels/interpret.py, a CPU) untuned layers run ``DEFAULT`` tiles:
  emulation checks the kernel's maths, not its speed.

The table is parsed from torch_xla's source rather than imported: the module imports JAX, and
the plan must not need a runtime.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import os

GENERATIONS = (4, 5, 6)      # the TPU generations AutoXLA's plan reports on
DEFAULT = (128, 128, 128)    # batch, out, in tiles: the kernel's minimum (multiples of 128)
_TABLE_FILE = ("experimental", "pallas_kernels", "quantized_matmul_kernel.py")


@functools.lru_cache(maxsize=1)
def table() -> dict[tuple, tuple[int, int, int]]:
    """torch_xla's TUNED_BLOCK_SIZES, or {} when torch_xla is not installed."""
    spec = importlib.util.find_spec("torch_xla")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = os.path.join(spec.submodule_search_locations[0], *_TABLE_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "TUNED_BLOCK_SIZES"):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{path} has no TUNED_BLOCK_SIZES table: torch_xla changed the kernel's "
                       "tuning; AutoXLA/quantization/pallas_tiles.py must follow it")


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tuned_token_counts(generation: int, out_features: int, in_features: int, dtype,
                       int8_activations: bool) -> list[int]:
    """The token counts torch_xla tuned this layer shape for on this TPU generation."""
    name = _dtype_name(dtype)
    return sorted(key[1] for key in table()
                  if key[0] == generation and key[2:] == (out_features, in_features, name,
                                                          int8_activations))


def tuned_generations(out_features: int, in_features: int, dtype,
                      int8_activations: bool) -> tuple[int, ...]:
    return tuple(g for g in GENERATIONS
                 if tuned_token_counts(g, out_features, in_features, dtype, int8_activations))


def tiles(generation: int | None, tokens: int, out_features: int, in_features: int, dtype,
          int8_activations: bool) -> tuple[int, int, int]:
    """(batch, out, in) tiles for one call; ``generation`` None is the emulated mode."""
    counts = (tuned_token_counts(generation, out_features, in_features, dtype, int8_activations)
              if generation is not None else [])
    if not counts:
        if generation is not None:
            raise ValueError(f"no tuned tiles for a ({out_features}, {in_features}) layer on TPU "
                             f"v{generation}: the plan should have chosen another backend")
        return DEFAULT
    at_least = [c for c in counts if c >= tokens]
    count = at_least[0] if at_least else counts[-1]
    return table()[(generation, count, out_features, in_features, _dtype_name(dtype),
                    int8_activations)]


def describe(out_features: int, in_features: int, dtype, int8_activations: bool) -> str:
    """One line for the plan: where this layer would run Pallas and where XLA's op."""
    parts = []
    for g in GENERATIONS:
        counts = tuned_token_counts(g, out_features, in_features, dtype, int8_activations)
        parts.append(f"v{g}: Pallas ({len(counts)} tuned token counts)" if counts
                     else f"v{g}: next backend (no tuned tiles)")
    return "; ".join(parts)
