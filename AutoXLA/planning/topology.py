"""Cloud TPU slices as data: chips, HBM per chip, hosts, interconnect (docs/planning.md cites
every value's source).

A slice's name counts TensorCores for v4 and v5p (two per chip: v4-8 is 4 chips) and chips for
v5e and v6e (one TensorCore per chip: v5e-8 is 8 chips). AutoXLA's devices are chips (the two
cores of a v4/v5p chip run as one device, megacore).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Generation:
    name: str
    hbm_bytes: int           # per chip
    cores_per_chip: int      # TensorCores a slice name counts per chip
    chips_per_host: int      # on a multi-host slice
    ici: str                 # the chips' interconnect
    max_chips: int           # chips in one slice at most
    single_host_max: int     # the largest slice on one host


GENERATIONS = {
    "v4": Generation("v4", 32 * GiB, 2, 4, "3D mesh (3D torus on slices of 4x4x8 and up)", 4096, 4),
    "v5e": Generation("v5e", 16 * GiB, 1, 4, "2D torus", 256, 8),
    "v5p": Generation("v5p", 95 * GiB, 2, 4, "3D torus", 6144, 4),
    "v6e": Generation("v6e", 32 * GiB, 1, 4, "2D torus", 256, 8),
}
# The slice sizes `--topology` offers (the name's count): the common shapes of each generation.
_SIZES = {"v4": (8, 16, 32, 64, 128, 256, 512), "v5e": (1, 4, 8, 16, 32, 64, 128, 256),
          "v5p": (8, 16, 32, 64, 128, 256, 512, 1024), "v6e": (1, 4, 8, 16, 32, 64, 128, 256)}
PRESETS = tuple(f"{g}-{n}" for g, sizes in _SIZES.items() for n in sizes)


@dataclass(frozen=True)
class Topology:
    name: str
    generation: Generation
    chips: int

    @property
    def hosts(self) -> int:
        g = self.generation
        return 1 if self.chips <= g.single_host_max else self.chips // g.chips_per_host

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def hbm_bytes(self) -> int:
        return self.generation.hbm_bytes

    def describe(self) -> str:
        dcn = "no DCN (one host)" if self.hosts == 1 else \
            f"{self.hosts} hosts joined by the data-center network (DCN), ICI across the slice"
        return (f"topology {self.name}: {self.chips} chips x {self.hbm_bytes / GiB:.0f} GiB HBM, "
                f"{self.hosts} host(s) x {self.chips_per_host} chips, ICI {self.generation.ici}; "
                f"{dcn}")

    def to_dict(self) -> dict:
        return {"name": self.name, "chips": self.chips, "hbm_bytes_per_chip": self.hbm_bytes,
                "hosts": self.hosts, "chips_per_host": self.chips_per_host,
                "ici": self.generation.ici}


def topology(name: str) -> Topology:
    """The preset ``name`` (e.g. "v5p-128"), or a ValueError that lists the presets."""
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", str(name).strip().lower()
                     .replace("v5litepod", "v5e"))
    if m is None or int(m.group(2)) not in _SIZES[m.group(1)]:
        raise ValueError(f"unknown topology {name!r}; use one of {', '.join(PRESETS)}")
    g = GENERATIONS[m.group(1)]
    return Topology(f"{g.name}-{m.group(2)}", g, int(m.group(2)) // g.cores_per_chip)
