"""The arguments that say how to load a checkpoint, shared by `autoxla generate` and `autoxla
serve`, and the load itself: tokenizer, then the model sharded (and quantized) as asked."""
from __future__ import annotations

import os
import time

from .. import backend
from ..loading.checkpoint import require_path_or_hub_id
from ..modeling import AutoXLAModelForCausalLM
from ..modeling.from_config import DTYPE_NAMES as dtypes
from ..quantization import QuantizationConfig
from ..sharding.hosts import SIMULATE_ENV


def add_model_arguments(p) -> None:
    p.add_argument("path", help="checkpoint directory (safetensors + config + tokenizer)")
    p.add_argument("--strategy", default="fsdp", help="fsdp, dp, mp, 2d or 3d (default fsdp)")
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices off a TPU (default 8)")
    p.add_argument("--dtype", default="auto", help="bf16, fp16, fp32 or auto (the checkpoint's)")
    p.add_argument("--bits", type=int, default=None, help="quantize linears to int8 (8) or int4 (4)")
    p.add_argument("--block-size", type=int, default=None,
                   help="elements per scale (-1: per channel; default: 32 for int4, -1 for int8)")
    p.add_argument("--attention", default="eager",
                   help="eager, xla_flash_attention or splash_attention (default eager)")
    p.add_argument("--compile-cache", default=None, help="directory of the persistent compile cache")


def load_model(args, verb: str, purpose: str):
    """(model, tokenizer, load seconds) for ``args`` of add_model_arguments; ``verb`` and
    ``purpose`` name the command and what it does in the errors."""
    backend.use_cpu_devices(args.devices)
    require_path_or_hub_id(args.path)
    if os.environ.get(SIMULATE_ENV):
        # One process standing in for one host of several loads only that host's shards: the
        # other devices hold NaN, and the text would be garbage (docs/multihost.md).
        raise ValueError(f"{SIMULATE_ENV}={os.environ[SIMULATE_ENV]} is set: this process would "
                         "load one simulated host's shards only and generate garbage; unset it "
                         f"(unset {SIMULATE_ENV}) to {purpose}")
    from transformers import AutoTokenizer

    dtype = "auto" if args.dtype == "auto" else dtypes.get(args.dtype.lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {args.dtype!r}; use auto or one of {', '.join(sorted(dtypes))}")
    quant = None
    if args.bits is not None:
        quant = QuantizationConfig(n_bits=args.bits, block_size=args.block_size)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{args.path} has no tokenizer transformers can load ({first}); "
                         f"autoxla {verb} needs the tokenizer files saved beside the weights "
                         "(tokenizer.save_pretrained(PATH))") from e
    t0 = time.perf_counter()
    model = AutoXLAModelForCausalLM.from_pretrained(
        args.path, sharding_strategy=args.strategy, dtype=dtype, quantization_config=quant,
        attn_implementation=args.attention, compile_cache=args.compile_cache)
    return model, tokenizer, time.perf_counter() - t0
