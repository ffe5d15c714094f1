"""Sharding strategies as mesh shapes.

Every strategy builds the same three-axis mesh ``("data", "fsdp", "model")`` and only chooses the
axis sizes, so one rule table (rules.py) serves them all. This module is pure Python: it needs the
device count, never the devices, so ``autoxla plan`` can run on a laptop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

AXES = ("data", "fsdp", "model")

# Accepted spellings (case-insensitive) -> canonical strategy name.
_ALIASES = {
    "fsdp": "fsdp",
    "dp": "dp",
    "data_parallel": "dp",
    "mp": "mp",
    "model_parallel": "mp",
    "2d": "2d",
    "3d": "3d",
}
STRATEGIES = tuple(sorted(set(_ALIASES)))


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the ("data", "fsdp", "model") axes."""

    data: int
    fsdp: int
    model: int

    def __post_init__(self):
        for axis, size in zip(AXES, self.sizes):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {axis!r} must be a positive int, got {size!r}")

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.model)

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.model

    def size(self, axes) -> int:
        """Number of shards a dimension gets when split over ``axes`` (a name, tuple or None)."""
        if axes is None:
            return 1
        if isinstance(axes, str):
            axes = (axes,)
        return math.prod(dict(zip(AXES, self.sizes))[a] for a in axes)

    def __str__(self) -> str:
        return "x".join(f"{a}={s}" for a, s in zip(AXES, self.sizes))


def format_spec(spec: tuple) -> str:
    """A partition spec as the plan prints it: ``(fsdp+data, model, -)``."""
    def one(a):
        if a is None:
            return "-"
        return a if isinstance(a, str) else "+".join(a)
    return "(" + ", ".join(one(a) for a in spec) + ")"


def normalize_strategy(strategy: str) -> str:
    """Canonical name of a strategy, or a ValueError that lists the valid ones."""
    if not isinstance(strategy, str) or strategy.strip().lower() not in _ALIASES:
        raise ValueError(
            f"unknown sharding_strategy {strategy!r}; use one of {', '.join(STRATEGIES)} "
            "(case-insensitive), or pass mesh= with your own Mesh"
        )
    return _ALIASES[strategy.strip().lower()]


# More devices than any TPU deployment has (a v5p pod is 8,960 chips); beyond it a count is a typo,
# and the divisor search below stays instant (sqrt of the limit steps).
MAX_DEVICES = 2**24


def _divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, in sqrt(n) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _balanced_split(n: int) -> tuple[int, int]:
    """(big, small) with big * small == n and small the largest divisor <= sqrt(n)."""
    small = max(d for d in _divisors(n) if d * d <= n)
    return n // small, small


def mesh_shape_for(strategy: str, num_devices: int) -> MeshShape:
    """The mesh a strategy uses on ``num_devices`` devices.

    The rule (docs/sharding.md): communication for the model axis happens inside every layer
    (all-reduce of activations), for fsdp once per parameter (all-gather of weights), and for data
    once per step (gradient reduction). So the axis that talks most gets the fewest devices:

    * fsdp = (1, N, 1); mp = (1, 1, N); dp = (N, 1, 1)
    * 2d   = (1, N / m, m), m the largest divisor of N with m * m <= N (8 -> 4 x 2)
    * 3d   = (d, f, m): m the largest divisor with m**3 <= N, then d <= f split N / m as 2d does
             (8 -> 2 x 2 x 2, 16 -> 2 x 4 x 2, 32 -> 4 x 4 x 2)
    A prime N leaves the smaller axes at 1; the plan shows the result.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    if num_devices > MAX_DEVICES:
        raise ValueError(f"num_devices={num_devices} is more devices than any TPU deployment has "
                         f"(AutoXLA plans up to {MAX_DEVICES}); check the count")
    kind = normalize_strategy(strategy)
    n = num_devices
    if kind == "fsdp":
        return MeshShape(1, n, 1)
    if kind == "mp":
        return MeshShape(1, 1, n)
    if kind == "dp":
        return MeshShape(n, 1, 1)
    if kind == "2d":
        fsdp, model = _balanced_split(n)
        return MeshShape(1, fsdp, model)
    # 3d: the model axis first (at most the cube root), then data <= fsdp from what is left.
    model = max(d for d in _divisors(n) if d ** 3 <= n)
    fsdp, data = _balanced_split(n // model)
    return MeshShape(data, fsdp, model)


def validate_mesh_axes(axis_names, mesh_shape, num_devices: int, example: str = "") -> MeshShape:
    """Checks a user mesh (names and sizes); returns its MeshShape.

    A user mesh names some of the axes ``data``, ``fsdp``, ``model`` (in any order, each at most
    once); the ones it leaves out have size 1, so the original AutoXLA's meshes
    (``("fsdp", "model")``, ``("data", "model")``, ``("data",)``) work as they are. Its sizes must
    multiply to the device count, since XLA does not run sub-meshes.
    """
    names = tuple(axis_names or ())
    sizes = tuple(int(s) for s in mesh_shape)
    example = example or f"Mesh(np.arange({num_devices}), (1, {num_devices}, 1), {AXES})"
    if len(names) != len(sizes):
        raise ValueError(f"mesh has {len(sizes)} dimensions {sizes} but {len(names)} axis names "
                         f"{names}: name every dimension with one of {AXES}, e.g. {example}")
    extra = [a for a in names if a not in AXES]
    if extra:
        raise ValueError(f"mesh has unknown axes {extra}; AutoXLA meshes use some of {AXES} "
                         f"(a missing axis has size 1), e.g. {example}")
    repeated = sorted({a for a in names if names.count(a) > 1})
    if repeated:
        raise ValueError(f"mesh names axis {repeated} more than once in {names}; name each "
                         f"dimension with a different one of {AXES}")
    total = math.prod(sizes)
    if total != num_devices:
        raise ValueError(
            f"mesh shape {sizes} covers {total} devices but the runtime has {num_devices}; "
            f"XLA needs a mesh over all devices: make the sizes multiply to {num_devices}"
        )
    by_name = dict(zip(names, sizes))
    return MeshShape(*(by_name.get(a, 1) for a in AXES))


def canonical_device_ids(device_ids, mesh_shape, axis_names) -> tuple[int, ...]:
    """The device ids of a mesh with some of the axes, laid out as the ``(data, fsdp, model)``
    mesh that puts every device at the same coordinates (missing axes have size 1).

    A mesh's device ids fill its shape in row-major order; transposing to the canonical axis
    order and inserting size-1 axes keeps each device's coordinate on every named axis.
    """
    import numpy as np

    names = tuple(axis_names or ())
    grid = np.asarray(device_ids).reshape(tuple(int(s) for s in mesh_shape))
    present = [a for a in AXES if a in names]
    grid = grid.transpose([names.index(a) for a in present])
    return tuple(int(i) for i in grid.reshape(-1))
