"""The `autoxla` command: one parser, the verbs registered from a table (``VERBS``), every user
error reported as one line. The verbs' usage is ``AutoXLA.cli``'s docstring (``--help``)."""
from __future__ import annotations

import argparse
import os
import sys

from . import demo, doctor, eval_quant, finetune, generate, merge, plan, quantize, serve
from . import __doc__ as usage

# The verbs, in --help's order: (name, one-line help, module with add_arguments(p) and run(args)).
VERBS = [
    ("plan", "print the sharding plan of a checkpoint from its config", plan),
    ("generate", "load a checkpoint sharded and stream generated text", generate),
    ("serve", "serve a checkpoint over HTTP (OpenAI's completions and chat) with continuous "
     "batching", serve),
    ("finetune", "LoRA / QLoRA fine-tuning of a checkpoint on JSON-lines data, resumable",
     finetune),
    ("eval-quant", "perplexity / SQNR and bytes per weight of quantization formats against the "
     "float model", eval_quant),
    ("quantize", "quantize a checkpoint on the CPU host (no XLA devices)", quantize),
    ("merge", "merge a LoRA adapter into its float checkpoint on the CPU host (float, or "
     "quantized with --bits)", merge),
    ("doctor", "versions, devices, C core ISA, Pallas, compile cache, and which attention kernels "
     "a checkpoint's layers can use", doctor),
    ("demo", "plan, load, generate and check a real model (SmolLM2-135M)", demo),
]


# The verbs that never use an XLA device, and promise not to import torch_xla (docs/planning.md,
# docs/quantization.md). accelerate, which peft needs, imports torch_xla as it is imported (by
# transformers' modeling code) wherever torch_xla is installed, unless its USE_TORCH_XLA switch
# is off: these verbs turn it off, unless the user set it.
HOST_ONLY_VERBS = ("plan", "quantize", "merge")


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
    parser = _Parser(prog="autoxla", description=usage,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_text, verb in VERBS:
        p = sub.add_parser(name, help=help_text)
        verb.add_arguments(p)
        p.set_defaults(func=verb.run)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # to start it again (--nproc)
    if args.command in HOST_ONLY_VERBS:
        os.environ.setdefault("USE_TORCH_XLA", "0")
    return args.func(args)
