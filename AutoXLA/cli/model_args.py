"""The arguments that say how to load a checkpoint, shared by `autoxla generate` and `autoxla
serve`, and the load itself: tokenizer, then the model sharded (and quantized) as asked."""
from __future__ import annotations

import os
import time

from .. import backend, runtimes
from ..loading.checkpoint import require_path_or_hub_id
from ..modeling import AutoXLAModelForCausalLM
from ..modeling.from_config import DTYPE_NAMES as dtypes
from ..quantization import QuantizationConfig
from ..runtimes.dtensor.launch import launch
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


def add_runtime_arguments(p) -> None:
    """--runtime and --nproc: the verbs that run on either runtime (docs/runtimes.md)."""
    p.add_argument("--runtime", choices=("xla", "dtensor"), default=None,
                   help="xla (torch_xla) or dtensor (torch.distributed, one process per device); "
                   "default: the installed one")
    p.add_argument("--nproc", type=int, default=None,
                   help="dtensor runtime: processes to start on this machine, one per device "
                   "(default 1; under torchrun, torchrun's)")


def runtime_of(args) -> str:
    name = runtimes.check_name(getattr(args, "runtime", None)) or runtimes.default()
    nproc = getattr(args, "nproc", None)
    if nproc is not None:
        if name != "dtensor":
            raise ValueError(f"--nproc {nproc} starts one process per device, which is the "
                             "dtensor runtime's model: add --runtime dtensor (the xla runtime "
                             "drives all of a host's devices from one process: --devices)")
        if nproc < 1:
            raise ValueError(f"--nproc {nproc}: give the number of processes (>= 1)")
    return name


def started_per_device(args, nproc: int | None) -> int | None:
    """On the dtensor runtime with ``nproc`` > 1 and not already one of a job's processes: this
    command again in ``nproc`` processes, one per device, as torchrun would start it; their first
    failing exit code (0 when all passed). None: run here."""
    if (nproc or 1) <= 1 or "RANK" in os.environ:
        return None
    codes = launch(nproc, ["-m", "AutoXLA.cli", *args.argv])
    return next((c for c in codes if c), 0)


def quantization_of(args) -> QuantizationConfig | None:
    """The format --bits and --block-size ask for (None: float)."""
    if args.bits is None:
        return None
    return QuantizationConfig(n_bits=args.bits, block_size=args.block_size)


def load_model(args, verb: str, purpose: str, runtimes_supported=("xla", "dtensor"),
               **loading):
    """(model, tokenizer, load seconds) for ``args`` of add_model_arguments; ``verb`` and
    ``purpose`` name the command and what it does in the errors; ``loading``: more keywords of
    from_pretrained."""
    runtime = runtime_of(args)
    if runtime not in runtimes_supported:
        raise ValueError(f"autoxla {verb} runs on the xla runtime only so far, and this "
                         f"environment has {runtime} (docs/runtimes.md): install torch_xla 2.9 "
                         "(docs/install.md)")
    if runtime == "xla":
        backend.use_cpu_devices(args.devices)
    elif args.attention != "eager" or args.compile_cache:
        raise ValueError("--attention and --compile-cache are xla-runtime options; the dtensor "
                         "runtime runs the model's own attention (transformers' default: docs/runtimes.md)")
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
    quant = quantization_of(args)
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
        attn_implementation=args.attention, compile_cache=args.compile_cache, runtime=runtime,
        **loading)
    return model, tokenizer, time.perf_counter() - t0
