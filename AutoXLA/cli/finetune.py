"""`autoxla finetune PATH --data FILE.jsonl --lora-rank R --steps N --out DIR`: LoRA (QLoRA with
--bits) on a checkpoint loaded sharded, with AutoXLA's loop (training/loop.py).

The adapters wrap every linear projection of the decoder layers. Run it again with the same
--out to resume from the last commit (a killed run continues where its last commit left it).
Writes DIR/metrics.jsonl (a line per step), DIR/checkpoints/ and DIR/adapter/ (peft's format:
loads with transformers + peft anywhere); with --merge MERGED also a full checkpoint with the
adapters merged in, on the host from PATH's files (training/merge.py: float, or quantized again
as the run's --bits; loads in transformers and in from_pretrained). On either
runtime: with --runtime dtensor --nproc N it starts N processes, one per device, and process 0
prints and writes the log (docs/finetuning.md).
"""
from __future__ import annotations

import os

import torch

from ..generation.engine import engine_of
from ..planning.adapters import plan_adapters
from ..state import state_of
from ..testing.real_model import chat_prompt
from ..training import FinetuneConfig, finetune, qlora, read_records
from ..training.merge import check_float_base, merge_checkpoint
from .model_args import (add_model_arguments, add_runtime_arguments, load_model, quantization_of,
                         runtime_of, started_per_device)


def add_arguments(p) -> None:
    add_model_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--data", required=True, help="JSON lines: {'messages': [...]}, "
                   "{'prompt', 'completion'} or {'text'} records")
    p.add_argument("--out", required=True, help="directory for metrics, checkpoints and adapter")
    p.add_argument("--lora-rank", type=int, required=True, help="LoRA rank r")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 r)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1, help="forwards per optimizer step")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--buckets", type=int, nargs="+", default=None,
                   help="sequence lengths to pad to (default 64 128 256 512)")
    p.add_argument("--eval-fraction", type=float, default=0.0, help="share held out")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--save-every", type=int, default=0, help="steps between commits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--ask", default=None, help="a question to answer (greedy, through the chat "
                   "template) before and after training, to see what it learned")
    p.add_argument("--merge", default=None, metavar="MERGED",
                   help="after training, write a full checkpoint with the adapters merged into "
                   "PATH's weights to MERGED (new or empty): float, or with --bits quantized "
                   "again in the run's format")


def run(args) -> int:
    from peft import LoraConfig, get_peft_model

    config = FinetuneConfig(
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        warmup_steps=args.warmup_steps, eval_fraction=args.eval_fraction,
        eval_every=args.eval_every, save_every=args.save_every, seed=args.seed,
        **({"buckets": tuple(args.buckets)} if args.buckets else {}))
    if args.lora_rank < 1:
        raise ValueError(f"--lora-rank {args.lora_rank}: give a rank >= 1")
    _check_merge(args)
    records = read_records(args.data)
    if runtime_of(args) == "dtensor":
        started = started_per_device(args, args.nproc)
        if started is not None:
            return started
    # scanned by default on the xla runtime (one layer compiled whatever the depth): the loop's
    # shard_adapters stacks the adapters with their layers
    model, tokenizer, seconds = load_model(args, "finetune", "fine-tune")
    writes = engine_of(model).writes_files()    # process 0 (asked before peft wraps the model)
    say = print if writes else (lambda *a, **k: None)
    # every decoder-layer projection, float or quantized: the plan names them
    targets = plan_adapters(state_of(model).plan, args.lora_rank).targets
    lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank,
                      lora_dropout=0.0, target_modules=list(targets))
    torch.manual_seed(args.seed)          # peft draws A from the global generator
    before = _answer(model, tokenizer, args.ask) if args.ask else None
    model = get_peft_model(model, qlora(lora))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(f"loaded in {seconds:.1f} s; LoRA r={args.lora_rank} on {', '.join(targets)}: "
          f"{trainable:,} trainable parameters")
    result = finetune(model, tokenizer, records, config, args.out, progress=not args.no_progress)
    if result.resumed_from:
        say(f"resumed from step {result.resumed_from}")
    last = result.steps[-1] if result.steps else None
    if last is not None:
        say(f"step {last['step']}: loss {last['loss']:.4f}"
              + (f", eval loss {result.eval_losses[-1]['loss']:.4f}" if result.eval_losses else ""))
    say(f"adapter: {result.adapter}")
    if args.ask:
        model.eval()
        after = _answer(model, tokenizer, args.ask)
        say(f"asked: {args.ask}\n  before: {before}\n  after:  {after}")
    if args.merge and writes:
        # from PATH's files on the host, one weight at a time: the same on either runtime, and a
        # QLoRA run's adapter goes into the float weights its base was quantized from
        merge_checkpoint(args.path, result.adapter, args.merge, quantization_of(args),
                         progress=not args.no_progress)
        tokenizer.save_pretrained(args.merge)   # usable as it is: `autoxla generate MERGED`
        say(f"merged checkpoint: {args.merge}")
    return 0


def _check_merge(args) -> None:
    """--merge's refusals, said before loading rather than after a long run."""
    if not args.merge:
        return
    if os.path.exists(args.merge) and os.listdir(args.merge):
        raise ValueError(f"--merge {args.merge}: the directory is not empty; give a new one "
                         "(a merged checkpoint never overwrites files)")
    check_float_base(args.path)


def _answer(model, tokenizer, question: str, max_new_tokens: int = 32) -> str:
    """The model's greedy answer to ``question`` through the chat template (or as it is)."""
    text = chat_prompt(tokenizer, question) if tokenizer.chat_template else question
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=not tokenizer.chat_template)
    out = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                         max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True).strip()
