"""`autoxla quantize SRC DST --bits 8|4`: a float checkpoint quantized on the CPU host, no XLA
devices (modeling/offline.py); DST then loads as it is, never quantized again."""
from __future__ import annotations

from ..modeling.from_config import DTYPE_NAMES as dtypes
from ..modeling.offline import quantize_checkpoint
from ..quantization import QuantizationConfig


def add_arguments(p) -> None:
    p.add_argument("src", help="float checkpoint directory (config.json and safetensors weights)")
    p.add_argument("dst", help="directory for the quantized checkpoint (new or empty; "
                   "--overwrite to replace the checkpoint in it)")
    add_format_arguments(p, bits_required=True)
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint in a DST "
                   "that is not empty (other files in it are kept)")


def add_format_arguments(p, bits_required: bool) -> None:
    """The quantization format, the float dtype and the files' shard size: `autoxla quantize`'s
    and `autoxla merge`'s (where --bits is optional: float without it)."""
    p.add_argument("--bits", type=int, required=bits_required, default=None, choices=(8, 4),
                   help="int8 (8) or int4 (4)" + ("" if bits_required else "; float without it"))
    p.add_argument("--block-size", type=int, default=None,
                   help="elements per scale (-1: per channel; default: 32 for int4, -1 for int8)")
    p.add_argument("--asym", action="store_true", help="asymmetric: a zero point per group")
    p.add_argument("--zero-point", choices=("int8", "float"), default=None,
                   help="with --asym: an int8 zero point (default) or a float offset per group")
    p.add_argument("--scale-dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="how scales are stored (default bfloat16)")
    search = p.add_mutually_exclusive_group()
    search.add_argument("--search", dest="search", action="store_true", default=None,
                        help="the C engine's error-minimising scale search (default for int4)")
    search.add_argument("--no-search", dest="search", action="store_false",
                        help="absmax / min-max scales (default for int8)")
    p.add_argument("--exclude", nargs="+", default=[], metavar="PATTERN",
                   help="layers kept in full precision (names or patterns, e.g. '*.o_proj')")
    p.add_argument("--quantize-lm-head", action="store_true", help="quantize the output "
                   "projection too (a head tied to the embeddings stays float)")
    p.add_argument("--quantize-embeddings", action="store_true",
                   help="also store the token embedding table as int8")
    p.add_argument("--dtype", default=None, help="dtype of the float tensors kept (default: the "
                   "checkpoint's, as from_pretrained loads it): bf16, fp16 or fp32")
    p.add_argument("--max-shard-size", default="2GB", help="as save_pretrained (default 2GB)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from(args):
    """The QuantizationConfig the arguments describe (None: no --bits, kept float)."""
    if args.bits is None:
        given = [flag for flag, value in (
            ("--block-size", args.block_size), ("--asym", args.asym),
            ("--zero-point", args.zero_point), ("--scale-dtype", args.scale_dtype),
            ("--search / --no-search", args.search), ("--exclude", args.exclude),
            ("--quantize-lm-head", args.quantize_lm_head),
            ("--quantize-embeddings", args.quantize_embeddings)) if value not in (None, False, [])]
        if given:
            raise ValueError(f"{given[0]} describes a quantization format: add --bits 8 or 4")
        return None
    if args.zero_point is not None and not args.asym:
        raise ValueError("--zero-point describes an asymmetric format: add --asym")
    kw = dict(n_bits=args.bits, block_size=args.block_size, symmetric=not args.asym,
              exclude_layers=list(args.exclude), quantize_lm_head=args.quantize_lm_head,
              quantize_embeddings=args.quantize_embeddings)
    for key, value in (("zero_point", args.zero_point), ("scale_dtype", args.scale_dtype),
                       ("scale_search", args.search)):
        if value is not None:
            kw[key] = value
    return QuantizationConfig(**kw)


def run(args) -> int:
    import sys
    import time

    config = config_from(args)
    start = time.perf_counter()
    dst = quantize_checkpoint(args.src, args.dst, config, dtype=dtype_from(args),
                              max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                              progress=False if args.quiet else None)
    size = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    print(f"quantized {args.src} -> {dst} ({config.n_bits}-bit, block_size {config.block_size}"
          f"{', asym' if not config.symmetric else ''}): {size / 2**20:.1f} MiB of weights in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def dtype_from(args):
    """--dtype as a torch dtype, or "auto" (the checkpoint's)."""
    if args.dtype is None:
        return "auto"
    import torch

    if args.dtype.lower() not in dtypes:
        raise ValueError(f"unknown dtype {args.dtype!r}; use one of {', '.join(sorted(dtypes))}")
    return getattr(torch, dtypes[args.dtype.lower()])
