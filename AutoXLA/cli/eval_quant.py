"""`autoxla eval-quant PATH`: the accuracy of quantization formats against the float model.

Prints one table: format, bytes per weight, perplexity (causal LMs, on --text or the text AutoXLA
ships) or worst output SQNR (segmentation models, on a fixed input), and the ratio to the float
model's perplexity. The formats are named in AutoXLA/evaluation/formats.py.
"""
from __future__ import annotations

import os

from .. import backend
from ..evaluation import evaluate
from ..evaluation.formats import FORMATS, SETS, bits_formats, parse_formats
from ..evaluation.perplexity import read_text
from ..runtimes.dtensor import process
from .model_args import add_runtime_arguments, runtime_of, started_per_device


def add_arguments(p) -> None:
    p.add_argument("path", nargs="?", help="local checkpoint directory (config.json, "
                   "safetensors, tokenizer)")
    p.add_argument("--formats", default=None,
                   help="comma-separated format names or sets (default: the set 'default' = "
                        f"{','.join(SETS['default'])}); 'all' for every format; "
                        "--list shows them")
    p.add_argument("--bits", type=int, nargs="+", default=None,
                   help="the 8-bit and/or 4-bit formats: --bits 8 4 (with --formats: both)")
    p.add_argument("--text", default=None, help="UTF-8 text file to score (default: the English "
                   "text AutoXLA ships, AutoXLA/data/eval_text.txt)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N "
                   "tokens (default: all of it)")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per forward; windows are scored independently (default 512)")
    p.add_argument("--strategy", default="2d", help="fsdp, dp, mp, 2d or 3d (default 2d)")
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (default 8)")
    add_runtime_arguments(p)
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    p.add_argument("--list", action="store_true", help="list the formats and exit (PATH unused)")


def formats_from(args) -> list:
    """The formats --formats and --bits name (validated before anything is loaded)."""
    out = []
    if args.formats is not None:
        out += parse_formats(args.formats)
    if args.bits is not None:
        out += bits_formats(args.bits)
    if not out:
        out = parse_formats("default")
    return list({f.name: f for f in out}.values())


def list_formats() -> str:
    width = max(map(len, FORMATS))
    lines = [f"{f.name.ljust(width)}  {f.kind:9s}  {f.about}" for f in FORMATS.values()]
    lines += [f"set {name}: {','.join(names)}" for name, names in SETS.items()]
    return "\n".join(lines)


def run(args) -> int:
    if args.list:
        print(list_formats())
        return 0
    formats = formats_from(args)
    for name in ("window", "max_tokens"):      # checked before any model loads
        value = getattr(args, name)
        if value is not None and value < 2:
            raise ValueError(f"--{name.replace('_', '-')} {value}: perplexity needs windows of at "
                             "least 2 tokens")
    if args.path is None:
        raise ValueError("eval-quant needs a checkpoint: autoxla eval-quant PATH [--formats ...]")
    if not os.path.isdir(args.path):
        raise FileNotFoundError(f"checkpoint directory {args.path} does not exist; eval-quant "
                                "reads a local checkpoint (config.json and safetensors weights, "
                                "e.g. from save_pretrained)")
    if not os.path.isfile(os.path.join(args.path, "config.json")):
        raise FileNotFoundError(f"{args.path} has no config.json; eval-quant reads a checkpoint "
                                "directory saved by save_pretrained (config.json and safetensors "
                                "weights)")
    if args.text is not None:
        read_text(args.text)                 # a bad file is reported before any model loads
    runtime = runtime_of(args)
    if runtime == "dtensor":
        started = started_per_device(args, args.nproc)
        if started is not None:              # this command again, one process per device
            return started
        process.ensure_process_group()
    else:
        backend.use_cpu_devices(args.devices)
    # Every process of a dtensor job evaluates (their collectives need them all); one prints
    shown = runtime != "dtensor" or process.rank() == 0
    say = (lambda m: print(m, flush=True)) if shown else (lambda _m: None)

    ev = evaluate(args.path, formats, text_file=args.text, strategy=args.strategy,
                  max_tokens=args.max_tokens, window=args.window, log=say, runtime=runtime)
    say(ev.table())
    if args.markdown:
        say(ev.markdown())
    return 0
