"""`autoxla merge BASE ADAPTER OUT [--bits 8|4 ...]`: a LoRA adapter (peft's format, e.g.
`autoxla finetune`'s OUT/adapter) merged into the float checkpoint BASE on the CPU host, one
weight at a time (training/merge.py): OUT is float in BASE's dtype, or quantized with --bits, and
loads in transformers and from_pretrained. No XLA devices; either runtime's interpreter."""
from __future__ import annotations

from ..training.merge import merge_checkpoint
from .quantize import add_format_arguments, config_from, dtype_from


def add_arguments(p) -> None:
    p.add_argument("base", help="the float checkpoint the adapter was trained on (for a QLoRA "
                   "run: the float checkpoint its base was quantized from)")
    p.add_argument("adapter", help="the adapter directory (adapter_config.json and "
                   "adapter_model.safetensors)")
    p.add_argument("out", help="directory for the merged checkpoint (new or empty; "
                   "--overwrite to replace the checkpoint in it)")
    add_format_arguments(p, bits_required=False)
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint in an OUT "
                   "that is not empty (other files in it are kept)")


def run(args) -> int:
    import sys
    import time

    config = config_from(args)
    start = time.perf_counter()
    out = merge_checkpoint(args.base, args.adapter, args.out, config, dtype=dtype_from(args),
                           max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                           progress=False if args.quiet else None)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    kind = f"{config.n_bits}-bit" if config is not None else "float"
    print(f"merged {args.adapter} into {args.base} -> {out} ({kind}): {size / 2**20:.1f} MiB of "
          f"weights in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
