"""QuantizationConfig: what to quantize and how, validated once (DESIGN.md section 5)."""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import asdict, dataclass, field, fields

# Saved as config.json["quantization_config"]; bump on any change of the saved layout.
# Version 2 adds int8 embedding tables (quantize_embeddings); a config without them is still
# written as version 1, so such checkpoints stay readable by an AutoXLA that reads only version 1.
# Version 3 adds scale dtypes other than bfloat16 (scale_dtype), float offsets (zero_point=
# "float", stored as weight_offset) and searched scales (scale_search: the layout is version 1's,
# but a reader that knows only 1 and 2 would refuse the key); each config is written with the
# lowest version that describes it.
FORMAT_VERSION = 1
EMBEDDINGS_FORMAT_VERSION = 2
FORMATS_FORMAT_VERSION = 3
READABLE_VERSIONS = (FORMAT_VERSION, EMBEDDINGS_FORMAT_VERSION, FORMATS_FORMAT_VERSION)
QUANT_METHOD = "autoxla"
BITS = (8, 4)
BACKENDS = ("auto", "pallas", "xla_op", "torch_int8", "fallback")
# The dtypes a scale can be stored in. bfloat16 is the default: float32's range (no weight can
# overflow it) at half the bytes; float16 has 3 more mantissa bits (a finer scale, so less error,
# measured in docs/quantization.md) but tops out at 65504; float32 costs twice the bytes.
SCALE_DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_SCALE_DTYPE = "bfloat16"
# An asymmetric block's zero: an int8 zero point (y = (q - zp) * scale) or a float offset in the
# scale dtype (y = q * scale + offset, llama.cpp's Q4_1 form: the block's minimum need not fall
# on the grid).
ZERO_POINTS = ("int8", "float")
# per_channel=False without a block_size: llama.cpp's Q4_0/Q8_0 block, which divides every width
# that is a multiple of 32 (nearly every model's hidden and intermediate sizes); a width it does
# not divide gets a shorter last block (ragged), like any other block size.
DEFAULT_BLOCK = 32
# block_size not given: int8 per-channel (as accurate as Q8_0 at fewer bytes); int4 in blocks of
# 32 with the scale search, the int4 format that beat every other at Q4_0's bytes
# (docs/benchmarks.md, "Quantization accuracy"; per-channel int4 is 1.8-2.2x float perplexity).
DEFAULT_BLOCK_FOR_BITS = {8: -1, 4: DEFAULT_BLOCK}

# Keywords of the original AutoXLA that change nothing here: each warns once per process.
_WARNED: set[str] = set()
_NO_EFFECT = {
    "pack_4bit": ("pack_4bit=False has no effect: int4 weights are always stored packed two per "
                  "byte (the C engine writes that layout and QuantizedLinear unpacks it inside "
                  "the compiled graph; an unpacked int4 weight would cost as much as int8)"),
    "auto_tune_block_sizes": (
        "auto_tune_block_sizes=False has no effect: AutoXLA runs torch_xla's Pallas int8 "
        "matmul only with the tiles torch_xla tuned for the layer's shape on the TPU's "
        "generation, and gives layers without them the next backend "
        "(AutoXLA/quantization/pallas_tiles.py, docs/quantization.md)"),
}


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=4)


@dataclass(frozen=True)
class LayerFormat:
    """The format of one quantized weight: (out, in) float -> q, scale (out, groups)[, zero point]."""

    bits: int
    symmetric: bool
    block_size: int       # elements per scale along the input dim; == in_features for per-channel
    in_features: int
    out_features: int
    scale_dtype: str = DEFAULT_SCALE_DTYPE   # one of SCALE_DTYPES
    offset: bool = False    # asymmetric with a float offset (weight_offset) instead of an int8 zero point
    search: bool = False    # the C engine's error-minimising scale search

    @property
    def torch_scale_dtype(self):
        import torch

        return getattr(torch, self.scale_dtype)

    @property
    def per_channel(self) -> bool:
        return self.block_size == self.in_features

    @property
    def groups(self) -> int:
        """Blocks per row: the last one is shorter when block_size does not divide in_features."""
        return -(-self.in_features // self.block_size)

    @property
    def ragged(self) -> bool:
        return self.in_features % self.block_size != 0

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
        if self.ragged:
            blocks += f" (last {self.in_features % self.block_size})"
        kind = "sym" if self.symmetric else "asym float offset" if self.offset else "asym"
        extras = ([f"{self.scale_dtype} scales"] if self.scale_dtype != DEFAULT_SCALE_DTYPE else []
                  ) + (["searched"] if self.search else [])
        return f"int{self.bits} {blocks} {kind}" + "".join(f", {e}" for e in extras)


@dataclass
class QuantizationConfig:
    """Weight quantization of a model's linear layers.

    n_bits: 8 or 4 (``bits`` is an alias: the seed uses both spellings).
    block_size: None (default) = per n_bits: -1 for int8, 32 for int4 (docs/quantization.md,
        "Which int4"); -1 = one scale per output channel; else elements per scale along the input
        dimension, any positive integer: where it does not divide a layer's input dimension the
        last block of each row is shorter (ragged), and where it is at least that dimension the
        layer has one block per row (per-channel).
    symmetric: True = scale only; False = scale and an int8 zero point per group.
    zero_point: with symmetric=False, "int8" (an int8 zero point per group) or "float" (a float
        offset per group in the scale dtype: y = q * scale + offset, like llama.cpp's Q4_1).
    scale_dtype: "bfloat16" (default), "float16" or "float32": how each scale is stored (the C
        engine rounds the float32 scale UP to it, so every value stays within half a step).
    scale_search: None (default) = on for int4, off for int8 (measured); True / False: the C
        engine's error-minimising search of each block's scale (and zero point / offset)
        instead of absmax / min-max: never a larger squared error on any block;
        weighted by the calibration's mean squared activations when calibration is given.
    quantize_activation: dynamic per-row int8 activations (W8A8) where the backend has them.
    use_pallas: None = the Pallas TPU kernel when running on a TPU; True = asked for it (a warning
        when it cannot be used); False = never.
    exclude_layers: module names or patterns kept in full precision ("lm_head", "mlp.down_proj",
        "layers.0", "*.o_proj"); a pattern matches a whole name, a glob, or a run of dotted parts.
    quantize_lm_head: quantize the output projection too (off by default; tied heads stay float).
    backend: "auto" (Pallas, then torch.ops.xla.quantized_matmul, then, for W8A8 without
        torch_xla, PyTorch's torch._int_mm ("torch_int8"), then the dequantize+matmul
        fallback, the first whose constraints the layer and device meet) or one of them by name.

    Keywords of the original AutoXLA (docs/quantization.md):
    per_channel: None = follow block_size; True = one scale per output channel (block_size must
        be -1); False = blockwise, with DEFAULT_BLOCK (32) when block_size is -1.
    quantize_embeddings: also store nn.Embedding tables as int8, one scale per row (always int8,
        also with n_bits=4); a table tied to the output projection stays in full precision.
    use_xla_kernel: False = never torch_xla's torch.ops.xla.quantized_matmul (backend "xla_op").
    pack_4bit: True (int4 is always packed two per byte); False warns once that it is anyway.
    auto_tune_block_sizes: True (the Pallas kernel runs with torch_xla's tuned tiles); False
        warns once that it cannot be turned off.
    """

    n_bits: int | None = None
    block_size: int | None = None
    symmetric: bool = True
    zero_point: str = "int8"
    scale_dtype: str = DEFAULT_SCALE_DTYPE
    scale_search: bool | None = None
    quantize_activation: bool = False
    use_pallas: bool | None = None
    exclude_layers: list[str] = field(default_factory=list)
    quantize_lm_head: bool = False
    backend: str = "auto"
    bits: int | None = None
    per_channel: bool | None = None
    quantize_embeddings: bool = False
    use_xla_kernel: bool = True
    pack_4bit: bool = True
    auto_tune_block_sizes: bool = True
    float_activation_layers: list[str] = field(default_factory=list)

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
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int)
                               or not (bs == -1 or bs >= 1)):
            raise ValueError(f"block_size={bs!r} is not supported; use -1 (per-channel) or a "
                             "positive number of inputs per scale, e.g. 32 or 128")
        self._resolve_per_channel()
        if self.scale_search is None:   # measured: the search helps every int4 format, not int8
            self.scale_search = self.n_bits == 4
        if self.zero_point not in ZERO_POINTS:
            raise ValueError(f"zero_point={self.zero_point!r} is not supported; use 'int8' (an "
                             "int8 zero point per group) or 'float' (a float offset per group)")
        if self.zero_point == "float" and self.symmetric:
            raise ValueError("zero_point='float' needs symmetric=False (a symmetric format has "
                             "no zero point); pass symmetric=False with it")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype!r} is not supported; use one of "
                             f"{', '.join(map(repr, SCALE_DTYPES))}")
        for name in ("symmetric", "scale_search", "quantize_activation", "quantize_lm_head", "quantize_embeddings",
                     "use_xla_kernel", "pack_4bit", "auto_tune_block_sizes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.use_pallas not in (None, True, False):
            raise ValueError(f"use_pallas must be True, False or None (auto), got {self.use_pallas!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown; use one of {', '.join(BACKENDS)}")
        if self.backend == "pallas" and self.use_pallas is False:
            raise ValueError("backend='pallas' contradicts use_pallas=False; drop one of them")
        if self.backend == "xla_op" and not self.use_xla_kernel:
            raise ValueError("backend='xla_op' (torch.ops.xla.quantized_matmul) contradicts "
                             "use_xla_kernel=False; drop one of them")
        if not self.pack_4bit and self.n_bits == 4:   # int8 is never packed, here as there
            _warn_once("pack_4bit", _NO_EFFECT["pack_4bit"])
        if not self.auto_tune_block_sizes:
            _warn_once("auto_tune_block_sizes", _NO_EFFECT["auto_tune_block_sizes"])
        for key in ("exclude_layers", "float_activation_layers"):
            value = getattr(self, key)
            value = [value] if isinstance(value, str) else list(value or [])
            for p in value:
                if not isinstance(p, str) or not p:
                    raise ValueError(f"{key} entries must be non-empty strings, got {p!r}")
            setattr(self, key, value)

    def _resolve_per_channel(self) -> None:
        """per_channel (the original's keyword) and block_size into one block_size; afterwards
        per_channel is True exactly when block_size is -1."""
        pc = self.per_channel
        if pc not in (None, True, False):
            raise ValueError(f"per_channel must be True, False or None (follow block_size), got {pc!r}")
        if self.block_size is None:      # not given: per_channel decides, else the bits' default
            self.block_size = (-1 if pc is True else DEFAULT_BLOCK if pc is False
                               else DEFAULT_BLOCK_FOR_BITS[self.n_bits])
        if pc is True and self.block_size != -1:
            raise ValueError(f"per_channel=True contradicts block_size={self.block_size} (one scale "
                             "per output channel has no blocks); pass block_size=-1, or "
                             "per_channel=False to quantize blockwise")
        if pc is False and self.block_size == -1:
            self.block_size = DEFAULT_BLOCK
        self.per_channel = self.block_size == -1

    # -- per layer ------------------------------------------------------------------------
    def layer_format(self, name: str, in_features: int, out_features: int) -> LayerFormat:
        """The format of layer ``name``: a block size at least its input dimension is one block
        per row (per-channel); one that does not divide it leaves a shorter last block."""
        block = in_features if self.block_size == -1 else min(self.block_size, in_features)
        return LayerFormat(self.n_bits, self.symmetric, block, in_features, out_features,
                           self.scale_dtype, self.zero_point == "float", self.scale_search)

    def embedding_format(self, num_embeddings: int, embedding_dim: int) -> LayerFormat:
        """An embedding table (vocab, hidden): int8 with one scale per row, whatever n_bits and
        block_size say (a row is what a lookup reads, so it is the natural group)."""
        return LayerFormat(8, self.symmetric, embedding_dim, embedding_dim, num_embeddings,
                           self.scale_dtype, False, self.scale_search)

    def excludes(self, name: str) -> str | None:
        """The exclude_layers pattern that matches module ``name``, or None."""
        return _match(self.exclude_layers, name)

    def float_activations(self, name: str) -> bool:
        """Whether layer ``name`` keeps float activations (float_activation_layers)."""
        return _match(self.float_activation_layers, name) is not None

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The saved form. per_channel is folded into block_size and pack_4bit /
        auto_tune_block_sizes change nothing, so none is saved; quantize_embeddings,
        use_xla_kernel, float_activation_layers, scale_dtype, zero_point and scale_search are saved only when not at their
        defaults, so a config that does not use them is the version-1 dict, byte for byte."""
        d = asdict(self)
        for key in ("bits", "per_channel", "pack_4bit", "auto_tune_block_sizes"):
            d.pop(key)
        for key, default in (("quantize_embeddings", False), ("use_xla_kernel", True),
                             ("float_activation_layers", []), ("scale_dtype", DEFAULT_SCALE_DTYPE),
                             ("zero_point", "int8"), ("scale_search", False)):
            if d[key] == default:
                d.pop(key)
        d["quant_method"] = QUANT_METHOD
        d["format_version"] = self._format_version()
        return d

    def _format_version(self) -> int:
        """The lowest saved-layout version that describes this config."""
        if (self.scale_dtype != DEFAULT_SCALE_DTYPE or self.zero_point != "int8"
                or self.scale_search):
            return FORMATS_FORMAT_VERSION
        return EMBEDDINGS_FORMAT_VERSION if self.quantize_embeddings else FORMAT_VERSION

    @classmethod
    def from_dict(cls, d: dict) -> "QuantizationConfig":
        d = dict(d)
        method = d.pop("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(f"quantization_config has quant_method={method!r}; AutoXLA reads only "
                             f"its own ({QUANT_METHOD!r}) checkpoints")
        version = d.pop("format_version", FORMAT_VERSION)
        if version not in READABLE_VERSIONS:
            raise ValueError(f"quantization_config format_version {version} is not one this "
                             f"AutoXLA reads {READABLE_VERSIONS}; upgrade AutoXLA or re-quantize")
        if version == FORMAT_VERSION and d.get("quantize_embeddings"):
            raise ValueError(f"quantization_config format_version {FORMAT_VERSION} has no "
                             "quantized embeddings, but says quantize_embeddings=True; the "
                             "config.json was edited or is damaged: re-save the checkpoint")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown quantization_config keys {unknown}; valid keys: {sorted(known)}")
        # Saved only when on (to_dict): a dict without it was not searched, whatever the bits'
        # default now is; block_size is always saved.
        d.setdefault("scale_search", False)
        d.setdefault("block_size", -1)
        return cls(**d)

    def same_weights_as(self, other: "QuantizationConfig") -> bool:
        """True when both produce the same stored tensors (runtime-only settings may differ)."""
        keys = ("n_bits", "block_size", "symmetric", "zero_point", "scale_dtype", "scale_search",
                "exclude_layers",
                "quantize_lm_head", "quantize_embeddings")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


def _match(patterns: list[str], name: str) -> str | None:
    """The first pattern matching module ``name``: the whole name, a glob, or a run of dotted parts."""
    for p in patterns:
        if name == p or fnmatch.fnmatchcase(name, p) or f".{p}." in f".{name}.":
            return p
    return None
