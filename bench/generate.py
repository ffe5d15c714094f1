"""transformers' generate loop on XLA against AutoXLA's fixed-shape generate, side by side.

Same checkpoint (the tiny Llama fixture), same 8 virtual XLA:CPU devices, same strategy, same
greedy request; each (side, new tokens) runs in a fresh process so that no side inherits the
other's compiled programs, and a process that dies (transformers' loop has aborted XLA:CPU with
"Cannot allocate memory" under 2d) or passes the time limit is reported, not fatal. Before timing,
both sides' tokens are checked against plain transformers on the CPU.

    ./run python bench/generate.py [--strategy 2d] [--tokens 8 32 128] [--limit 300]

Prints, per side and length: programs compiled (torch_xla's CompileTime count), wall time of the
first call, and decode tokens/s of a second, identical call (everything compiled by then).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from child import run_json_child

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [0, 0, 0, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def one(side: str, tokens: int, strategy: str, path: str) -> dict:
    """Runs in the child process: load, check, generate twice, report."""
    import torch
    from transformers import AutoModelForCausalLM

    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy)
    ids = torch.tensor(PROMPT)
    mask = (ids != 0).long()
    args = dict(max_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    dev = backend.device()
    run = model.generate if side == "autoxla" else (lambda **kw: type(model).generate(model, **kw))
    c0, t0 = backend.compile_count(), time.perf_counter()
    got = run(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args).cpu()
    first = time.perf_counter() - t0
    compiled = backend.compile_count() - c0
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    correct = torch.equal(got, reference.generate(input_ids=ids, attention_mask=mask, **args))
    c1, t1 = backend.compile_count(), time.perf_counter()
    run(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args).cpu()
    again = time.perf_counter() - t1
    return {"compiled": compiled, "first_s": first, "second_s": again,
            "second_compiled": backend.compile_count() - c1, "correct": correct,
            "decode_tps": ids.shape[0] * tokens / again}


def spawn(side: str, tokens: int, strategy: str, path: str, limit: float) -> dict:
    r = run_json_child([__file__, "--child", side, str(tokens), strategy, path], limit)
    return {"cut": r["error"]} if "error" in r else r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="2d")
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--limit", type=float, default=300, help="seconds per process (default 300)")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        side, tokens, strategy, path = a.child
        print(json.dumps(one(side, int(tokens), strategy, path)))
        return 0
    sys.path.insert(0, str(ROOT))
    from AutoXLA.testing.tiny import save_tiny_checkpoint

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"8 virtual XLA:CPU devices, strategy {a.strategy}, tiny Llama, batch 2, greedy")
    print(f"{'new tokens':>10}  {'side':<13} {'programs':>8} {'first call s':>12} "
          f"{'2nd call s':>10} {'decode tok/s':>12}  note")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(save_tiny_checkpoint("llama", Path(tmp) / "llama"))
        for n in a.tokens:
            rows = {side: spawn(side, n, a.strategy, path, a.limit) for side in ("transformers", "autoxla")}
            for side, r in rows.items():
                if "cut" in r:
                    print(f"{n:>10}  {side:<13} {'-':>8} {'-':>12} {'-':>10} {'-':>12}  {r['cut']}")
                    continue
                note = "tokens equal plain transformers" if r["correct"] else "TOKENS DIFFER"
                note += f"; 2nd call compiled {r['second_compiled']}"
                print(f"{n:>10}  {side:<13} {r['compiled']:>8} {r['first_s']:>12.1f} "
                      f"{r['second_s']:>10.2f} {r['decode_tps']:>12.1f}  {note}")
            t, x = rows["transformers"], rows["autoxla"]
            if "cut" not in t and "cut" not in x:
                print(f"{'':>10}  ratio: {t['compiled'] / max(x['compiled'], 1):.1f}x the programs, "
                      f"{t['first_s'] / x['first_s']:.1f}x the first-call time, "
                      f"{x['decode_tps'] / t['decode_tps']:.1f}x AutoXLA's decode speed after warm-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
