"""The formats `autoxla eval-quant` compares, by name: one table entry each.

An entry says how to build the format, nothing about how it is evaluated (every format goes
through the same loader and the same evaluator, evaluation/run.py):
- ``float``: the checkpoint as stored, the reference every ratio is taken against;
- ``autoxla(...)``: QuantizationConfig keywords (and optionally extra from_pretrained keywords,
  e.g. a calibration argument), quantized by AutoXLA as it loads;
- ``llama_cpp(...)``: a gguf.quants type (llama.cpp's reference quantizers): the same linears
  AutoXLA would quantize are quantized and dequantized by gguf, written into a float checkpoint
  and loaded as float (evaluation/llama_cpp.py).
A new format is one more line in FORMATS. Each entry names every keyword that decides its format
(block_size, scale_search), so a change of QuantizationConfig's defaults cannot change a row.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..quantization import QuantizationConfig

FLOAT, AUTOXLA, LLAMA_CPP = "float", "autoxla", "llama.cpp"


@dataclass(frozen=True)
class Format:
    name: str
    kind: str                                   # FLOAT, AUTOXLA or LLAMA_CPP
    about: str
    config: dict = field(default_factory=dict)  # QuantizationConfig keywords
    load: dict = field(default_factory=dict)    # extra from_pretrained keywords (AUTOXLA only)
    gguf_type: str | None = None                # gguf.GGMLQuantizationType name (LLAMA_CPP)

    def quantization_config(self):
        """AUTOXLA: the config to load with. LLAMA_CPP: the config whose plan picks the linears
        to quantize (its bits do not matter: only which layers, exclude_layers and
        quantize_lm_head decide that)."""
        return QuantizationConfig(**{"bits": 8, **self.config})


def autoxla(name: str, about: str, load: dict | None = None, **config) -> Format:
    return Format(name, AUTOXLA, about, config, dict(load or {}))


def llama_cpp(gguf_type: str, about: str, **config) -> Format:
    return Format(gguf_type.lower(), LLAMA_CPP, about, config, gguf_type=gguf_type)


FORMATS = {f.name: f for f in (
    Format("float", FLOAT, "the checkpoint's own weights (the reference)"),
    autoxla("int8", "int8 per-channel symmetric, bf16 scale per row", bits=8),
    autoxla("w8a8", "int8 per-channel weights and dynamic per-row int8 activations", bits=8,
            quantize_activation=True),
    autoxla("int8-b32", "int8 blocks of 32, symmetric", bits=8, block_size=32),
    autoxla("int8-b32-fp16", "int8 blocks of 32, symmetric, float16 scales (Q8_0's layout and "
            "bytes)", bits=8, block_size=32, scale_dtype="float16", scale_search=False),
    autoxla("int8-b32-fp16-search", "int8-b32-fp16 with the error-minimising scale search", bits=8,
            block_size=32, scale_dtype="float16", scale_search=True),
    autoxla("int8-search", "int8 per-channel with the error-minimising scale search", bits=8,
            scale_search=True),
    autoxla("w8a8-smooth", "w8a8 after SmoothQuant, calibrated on AutoXLA's calibration text",
            load={"calibration": True}, bits=8, quantize_activation=True),
    autoxla("int4-pc", "int4 per-channel symmetric", bits=4, block_size=-1, scale_search=False),
    autoxla("int4-pc-asym", "int4 per-channel with an int8 zero point per row", bits=4,
            symmetric=False, block_size=-1, scale_search=False),
    autoxla("int4-b32", "int4 blocks of 32, symmetric (bytes of Q4_0)", bits=4, block_size=32,
            scale_search=False),
    autoxla("int4-b32-asym", "int4 blocks of 32, int8 zero point per block", bits=4,
            block_size=32, symmetric=False, scale_search=False),
    autoxla("int4-b32-search", "int4-b32 with the error-minimising scale search", bits=4,
            block_size=32, scale_search=True),
    autoxla("int4-b32-asym-search", "int4-b32-asym with the scale search", bits=4,
            block_size=32, symmetric=False, scale_search=True),
    autoxla("int4-b32-offset", "int4 blocks of 32, fp16 scale and fp16 float offset (Q4_1's "
            "layout and bytes)", bits=4, block_size=32, symmetric=False, zero_point="float",
            scale_dtype="float16", scale_search=False),
    autoxla("int4-b32-offset-search", "int4-b32-offset with the scale search", bits=4,
            block_size=32, symmetric=False, zero_point="float", scale_dtype="float16",
            scale_search=True),
    autoxla("int4-b32-search-fp16", "int4-b32-search with float16 scales (bytes of Q4_0)", bits=4,
            block_size=32, scale_search=True, scale_dtype="float16"),
    autoxla("int4-pc-search", "int4 per-channel with the scale search", bits=4, block_size=-1,
            scale_search=True),
    autoxla("int4-b64", "int4 blocks of 64, symmetric", bits=4, block_size=64, scale_search=False),
    autoxla("int4-b64-offset-search", "int4 blocks of 64, float scale and offset, searched "
            "(bytes of Q4_0)", bits=4, block_size=64, symmetric=False, zero_point="float",
            scale_search=True),
    autoxla("int4-b64-asym", "int4 blocks of 64, int8 zero point per block", bits=4,
            block_size=64, symmetric=False, scale_search=False),
    autoxla("int4-b128", "int4 blocks of 128 (a ragged last block where 128 does not divide)",
            bits=4, block_size=128, scale_search=False),
    llama_cpp("Q8_0", "llama.cpp: blocks of 32 int8, fp16 scale"),
    llama_cpp("Q5_0", "llama.cpp: blocks of 32 5-bit, fp16 scale"),
    llama_cpp("Q5_1", "llama.cpp: blocks of 32 5-bit, fp16 scale and fp16 minimum"),
    llama_cpp("Q4_0", "llama.cpp: blocks of 32 4-bit, fp16 scale"),
    llama_cpp("Q4_1", "llama.cpp: blocks of 32 4-bit, fp16 scale and fp16 minimum"),
)}

# Names for several formats at once; `--bits 8` / `--bits 4` are the 8- and 4-bit sets.
SETS = {
    "8": ("int8", "w8a8", "q8_0"),
    "4": ("int4-b32-search", "int4-b32", "int4-b32-asym", "int4-b64", "int4-pc", "q4_0", "q4_1"),
    # The comparison of issue 14: every AutoXLA format beside llama.cpp's at equal bits; the
    # first of each bit width is what QuantizationConfig(bits=...) gives.
    "default": ("int8", "w8a8", "q8_0", "int4-b32-search", "int4-b32", "int4-b32-asym",
                "int4-b64", "int4-pc", "q4_0", "q4_1"),
    "all": tuple(n for n in FORMATS if n != "float"),
}


def parse_formats(spec: str | list[str] | tuple[str, ...]) -> list[Format]:
    """"int8,q8_0" or ["int8", "q8_0"] (set names expand, duplicates drop) -> formats in order.
    "float" is always evaluated as the reference and need not be named."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for raw in names:
        name = raw.strip().lower()
        if not name:
            continue
        for n in SETS.get(name, (name,)):
            if n not in FORMATS:
                raise ValueError(f"unknown format {raw.strip()!r}; choose from "
                                 f"{', '.join(FORMATS)} or a set: {', '.join(SETS)} "
                                 "(docs/quantization.md, 'Measuring accuracy')")
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError(f"no format named in {spec!r}; e.g. --formats int8,q8_0")
    return [FORMATS[n] for n in out]


def bits_formats(bits: list[int]) -> list[Format]:
    """`--bits 8 4`: the 8- and/or 4-bit sets."""
    bad = [b for b in bits if str(b) not in ("8", "4")]
    if bad:
        raise ValueError(f"--bits {bad[0]} is not a format set; use --bits 8 and/or --bits 4, "
                         "or name formats with --formats")
    return parse_formats([str(b) for b in bits])
