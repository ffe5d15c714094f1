"""QuantizationConfig: what to quantize and how, validated once (DESIGN.md section 5)."""
from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field, fields

# Saved as config.json["quantization_config"]; bump on any change of the saved layout.
FORMAT_VERSION = 1
QUANT_METHOD = "autoxla"
BITS = (8, 4)
BACKENDS = ("auto", "pallas", "xla_op", "fallback")
MIN_BLOCK, MAX_BLOCK, BLOCK_MULTIPLE = 32, 1024, 32


@dataclass(frozen=True)
class LayerFormat:
    """The format of one quantized weight: (out, in) float -> q, scale (out, groups)[, zero point]."""

    bits: int
    symmetric: bool
    block_size: int       # elements per scale along the input dim; == in_features for per-channel
    in_features: int
    out_features: int

    @property
    def per_channel(self) -> bool:
        return self.block_size == self.in_features

    @property
    def groups(self) -> int:
        return self.in_features // self.block_size

    @property
    def q_shape(self) -> tuple[int, int]:
        """int8 stores one value per byte; int4 two per byte (element 2j in the low nibble)."""
        cols = self.in_features if self.bits == 8 else (self.in_features + 1) // 2
        return (self.out_features, cols)

    @property
    def scale_shape(self) -> tuple[int, int]:
        return (self.out_features, self.groups)

    @property
    def label(self) -> str:
        blocks = "per-channel" if self.per_channel else f"block {self.block_size}"
        return f"int{self.bits} {blocks} {'sym' if self.symmetric else 'asym'}"


@dataclass
class QuantizationConfig:
    """Weight quantization of a model's linear layers.

    n_bits: 8 or 4 (``bits`` is an alias: the seed uses both spellings).
    block_size: -1 = one scale per output channel; else elements per scale along the input
        dimension, a multiple of 32 from 32 to 1024 that divides each quantized layer's input.
    symmetric: True = scale only; False = scale and an int8 zero point per group.
    quantize_activation: dynamic per-row int8 activations (W8A8) where the backend has them.
    use_pallas: None = the Pallas TPU kernel when running on a TPU; True = asked for it (a warning
        when it cannot be used); False = never.
    exclude_layers: module names or patterns kept in full precision ("lm_head", "mlp.down_proj",
        "layers.0", "*.o_proj"); a pattern matches a whole name, a glob, or a run of dotted parts.
    quantize_lm_head: quantize the output projection too (off by default; tied heads stay float).
    backend: "auto" (Pallas, then torch.ops.xla.quantized_matmul, then the dequantize+matmul
        fallback, the first whose constraints the layer and device meet) or one of them by name.
    """

    n_bits: int | None = None
    block_size: int = -1
    symmetric: bool = True
    quantize_activation: bool = False
    use_pallas: bool | None = None
    exclude_layers: list[str] = field(default_factory=list)
    quantize_lm_head: bool = False
    backend: str = "auto"
    bits: int | None = None

    def __post_init__(self):
        if self.bits is not None and self.n_bits is not None and self.bits != self.n_bits:
            raise ValueError(f"bits={self.bits} and n_bits={self.n_bits} disagree; they are the "
                             "same setting: pass one of them")
        n_bits = self.n_bits if self.n_bits is not None else self.bits
        n_bits = 8 if n_bits is None else n_bits
        if isinstance(n_bits, bool) or n_bits not in BITS:
            raise ValueError(f"n_bits={n_bits!r} is not supported; use 8 (int8) or 4 (int4)")
        self.n_bits = self.bits = int(n_bits)
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or not (
                bs == -1 or (MIN_BLOCK <= bs <= MAX_BLOCK and bs % BLOCK_MULTIPLE == 0)):
            raise ValueError(f"block_size={bs!r} is not supported; use -1 (per-channel) or a "
                             f"multiple of {BLOCK_MULTIPLE} from {MIN_BLOCK} to {MAX_BLOCK}, "
                             "e.g. 64 or 128")
        for name in ("symmetric", "quantize_activation", "quantize_lm_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.use_pallas not in (None, True, False):
            raise ValueError(f"use_pallas must be True, False or None (auto), got {self.use_pallas!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown; use one of {', '.join(BACKENDS)}")
        if self.backend == "pallas" and self.use_pallas is False:
            raise ValueError("backend='pallas' contradicts use_pallas=False; drop one of them")
        if isinstance(self.exclude_layers, str):
            self.exclude_layers = [self.exclude_layers]
        self.exclude_layers = list(self.exclude_layers or [])
        for p in self.exclude_layers:
            if not isinstance(p, str) or not p:
                raise ValueError(f"exclude_layers entries must be non-empty strings, got {p!r}")

    # -- per layer ------------------------------------------------------------------------
    def layer_format(self, name: str, in_features: int, out_features: int) -> LayerFormat:
        """The format of layer ``name``; a block size that does not divide it is an error."""
        block = in_features if self.block_size == -1 else self.block_size
        if in_features % block:
            raise ValueError(
                f"block_size={self.block_size} does not divide the input dimension "
                f"({in_features}) of layer {name!r}; choose a block size that divides it, use "
                f"block_size=-1 (per-channel), or add {name!r} to exclude_layers")
        return LayerFormat(self.n_bits, self.symmetric, block, in_features, out_features)

    def excludes(self, name: str) -> str | None:
        """The exclude_layers pattern that matches module ``name``, or None."""
        for p in self.exclude_layers:
            if name == p or fnmatch.fnmatchcase(name, p) or f".{p}." in f".{name}.":
                return p
        return None

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("bits")
        d["quant_method"] = QUANT_METHOD
        d["format_version"] = FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantizationConfig":
        d = dict(d)
        method = d.pop("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(f"quantization_config has quant_method={method!r}; AutoXLA reads only "
                             f"its own ({QUANT_METHOD!r}) checkpoints")
        version = d.pop("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"quantization_config format_version {version} is not the one this "
                             f"AutoXLA writes ({FORMAT_VERSION}); upgrade AutoXLA or re-quantize")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown quantization_config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**d)

    def same_weights_as(self, other: "QuantizationConfig") -> bool:
        """True when both produce the same stored tensors (runtime-only settings may differ)."""
        keys = ("n_bits", "block_size", "symmetric", "exclude_layers", "quantize_lm_head")
        return all(getattr(self, k) == getattr(other, k) for k in keys)
