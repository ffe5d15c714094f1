"""The two runtimes side by side on one machine, in one run: load time, peak host memory and
greedy decode tokens/s at batch 1, 8 and 16 for transformers' eager loop, the xla runtime
(torch_xla 2.9 on 1 XLA:CPU device) and the dtensor runtime (torch 2.14.1, 1, 2 and 4 gloo
processes), on the tiny Llama fixture and the real SmolLM2-135M-Instruct, fp32 everywhere.

    ./run python bench/runtimes.py [--tokens 32] [--batches 1 8 16] [--nproc 1 2 4]
                                   [--models tiny smollm2]

Each side runs in fresh processes (the dtensor ones in the dtensor runtime's venv, through
./run dtensor); transformers' eager loop runs on both torches, since the runtimes do not share
one. Decode tokens/s: batch x (N - 1) / (time of N new tokens - time of 1), after a warm-up call
(which compiles, on the xla side). Peak host memory: the largest resident set of each process
(ru_maxrss), summed over the dtensor ranks, imports included. With several processes, the
collectives' share is the gloo collectives' own CPU time on rank 0 over its wall time of one
decode call at the largest batch (torch.profiler: the CPU time under DTensor's Redistribute,
which holds the collectives, their waits and DTensor's bookkeeping around them). Every side's greedy tokens are compared with
transformers' on the same torch. Last, per model, the dtensor runtime (1 process) and
transformers' eager loop side by side in one process, alternating (``side_by_side``): separate
processes on this machine differ by up to 15 % from run to run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
PROMPT = "The capital of France is a city where"


def _prompts(tokenizer_path: str, batch: int):
    import torch

    if not tokenizer_path:                      # the tiny model: token ids
        ids = torch.arange(5, 21).repeat(batch, 1)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path)
        ids = tok([PROMPT] * batch, return_tensors="pt").input_ids
    return ids, torch.ones_like(ids)


def _decode(model, tokenizer_path: str, batches, tokens: int, profile_batch=None) -> dict:
    """{batch: tokens/s, tokens} of ``model.generate``, greedy; optionally the collectives'
    share of one call at ``profile_batch``."""
    import torch

    out = {}
    args = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    for batch in batches:
        ids, mask = _prompts(tokenizer_path, batch)

        def run(n):
            t0 = time.perf_counter()
            with torch.no_grad():
                got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                     min_new_tokens=n, **args)
            return time.perf_counter() - t0, got

        run(tokens)                                        # warm-up (compiles on XLA)
        run(1)
        one, _ = run(1)
        full, got = run(tokens)
        out[str(batch)] = {"tps": batch * (tokens - 1) / (full - one),
                           "tokens": got.cpu()[:, ids.shape[1]:].tolist()}
        if batch == profile_batch:
            out["collectives_share"] = _collectives_share(lambda: run(tokens))
    return out


def _collectives_share(call) -> float:
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    wall = time.perf_counter() - t0
    # DTensor's redistributions: the collectives, their waits and DTensor's own bookkeeping
    # around them (the gathers of every module's shards, the logits' gather)
    collective = sum(e.cpu_time_total for e in prof.key_averages() if e.key == "Redistribute")
    return collective / 1e6 / wall


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the sides, each in a fresh process ------------------------------------------------------

def side_eager(path, tokenizer, batches, tokens) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    load = time.perf_counter() - t0
    out = _decode(model, tokenizer, batches, tokens)
    return dict(load_s=load, peak_mb=_peak_mb(), torch=torch.__version__, decode=out)


def side_xla(path, tokenizer, batches, tokens) -> dict:
    import torch

    from AutoXLA.modeling import AutoXLAModelForCausalLM

    t0 = time.perf_counter()
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="fsdp",
                                                    runtime="xla", dtype=torch.float32)
    load = time.perf_counter() - t0
    out = _decode(model, tokenizer, batches, tokens)
    return dict(load_s=load, peak_mb=_peak_mb(), torch=torch.__version__, decode=out)


def side_dtensor_rank(path, tokenizer, batches, tokens, out_dir) -> None:
    import torch
    import torch.distributed as dist

    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.runtimes.dtensor.process import ensure_process_group

    ensure_process_group("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    t0 = time.perf_counter()
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="fsdp",
                                                    runtime="dtensor", dtype=torch.float32)
    load = time.perf_counter() - t0
    # every rank runs the profiled call (its collectives need them all); rank 0 reports
    profile_batch = max(batches) if world > 1 else None
    out = _decode(model, tokenizer, batches, tokens, profile_batch)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(dict(load_s=load, peak_mb=_peak_mb(), torch=torch.__version__, decode=out), f)
    dist.destroy_process_group()


def side_by_side(path, tokenizer, batches, tokens, pairs: int = 5) -> dict:
    """In one process (a world of one), the dtensor runtime's generate and transformers' eager
    loop alternately, ``pairs`` times per batch: decode ms per step of each, medians. Separate
    processes on this machine differ by up to 15 % from run to run; alternating in one process
    puts both under the same conditions."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM

    from AutoXLA.modeling import AutoXLAModelForCausalLM

    ours = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="fsdp",
                                                   runtime="dtensor", dtype=torch.float32)
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    args = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    out = {}
    for batch in batches:
        ids, mask = _prompts(tokenizer, batch)

        def step_ms(model):
            with torch.no_grad():
                t0 = time.perf_counter()
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1,
                               min_new_tokens=1, **args)
                t1 = time.perf_counter()
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens,
                               min_new_tokens=tokens, **args)
                return 1000 * ((time.perf_counter() - t1) - (t1 - t0)) / (tokens - 1)

        step_ms(ours), step_ms(eager)                      # warm-up
        times = [(step_ms(ours), step_ms(eager)) for _ in range(pairs)]
        out[str(batch)] = {"ours_ms": statistics.median(t[0] for t in times),
                           "eager_ms": statistics.median(t[1] for t in times)}
    return out


def side_dtensor(path, tokenizer, batches, tokens, nproc) -> dict:
    from AutoXLA.runtimes.dtensor.launch import launch

    with tempfile.TemporaryDirectory() as out_dir:
        argv = [__file__, "--side", "dtensor-rank", "--path", path, "--tokenizer", tokenizer,
                "--batches", *map(str, batches), "--tokens", str(tokens), "--out", out_dir]
        codes = launch(nproc, argv, timeout=3600)
        if codes != [0] * nproc:
            return {"error": f"ranks exited with {codes}"}
        ranks = [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(nproc)]
    first = ranks[0]
    first["load_s"] = max(r["load_s"] for r in ranks)
    first["peak_mb"] = sum(r["peak_mb"] for r in ranks)
    return first


def _child(interpreter: list[str], side: str, path: str, tokenizer: str, a, extra=()) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CPU_NUM_DEVICES="1", PJRT_DEVICE="CPU",
               TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [*interpreter, __file__, "--side", side, "--path", path, "--tokenizer", tokenizer,
           "--batches", *map(str, a.batches), "--tokens", str(a.tokens), *extra]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.limit)
    except subprocess.TimeoutExpired:
        return {"error": f"not finished after {a.limit:.0f} s"}
    if out.returncode != 0:
        tail = [l for l in out.stderr.strip().splitlines() if l.strip()][-1:] or ["?"]
        return {"error": f"exit {out.returncode}: {tail[0][:160]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    p.add_argument("--limit", type=float, default=3600, help="seconds per side")
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if a.side == "dtensor-rank":
        side_dtensor_rank(a.path, a.tokenizer, a.batches, a.tokens, a.out)
        return 0
    if a.side:
        sides = {"eager": side_eager, "xla": side_xla, "side-by-side": side_by_side}
        result = (side_dtensor(a.path, a.tokenizer, a.batches, a.tokens, a.n)
                  if a.side == "dtensor" else sides[a.side](a.path, a.tokenizer, a.batches,
                                                            a.tokens))
        print(json.dumps(result))
        return 0

    from child import decode_checkpoints

    xla_py = [sys.executable]
    dtensor_py = [str(ROOT / "run"), "dtensor"]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; greedy, {a.tokens} new tokens, fp32, strategy fsdp; "
          f"each dtensor rank uses cores/nproc threads")
    with tempfile.TemporaryDirectory() as tmp:
        paths = decode_checkpoints(a.models, tmp)
        header = (f"{'model':<8} {'side':<30} {'load s':>7} {'peak MB':>8} "
                  + " ".join(f"{'b' + str(b) + ' tok/s':>11}" for b in a.batches) + "  notes")
        print(header)
        for name, (path, tokenizer) in paths.items():
            rows = [("transformers eager (torch 2.9)", _child(xla_py, "eager", path, tokenizer, a)),
                    ("transformers eager (torch 2.14)",
                     _child(dtensor_py, "eager", path, tokenizer, a)),
                    ("xla runtime, 1 XLA:CPU device", _child(xla_py, "xla", path, tokenizer, a))]
            for n in a.nproc:
                rows.append((f"dtensor runtime, {n} process{'es' if n > 1 else ''}",
                             _child(dtensor_py, "dtensor", path, tokenizer, a, ["--n", str(n)])))
            for label, r in rows:
                if "error" in r:
                    print(f"{name:<8} {label:<30} {r['error']}")
                    continue
                # each runtime against transformers on its own torch
                on_new_torch = "dtensor" in label or "2.14" in label
                eager_ref = rows[1][1] if on_new_torch else rows[0][1]
                ref = eager_ref if "error" not in eager_ref else r
                same = all(r["decode"][str(b)]["tokens"] == ref["decode"][str(b)]["tokens"]
                           for b in a.batches)
                ratios = "/".join(f"{r['decode'][str(b)]['tps'] / eager_ref['decode'][str(b)]['tps']:.2f}"
                                  for b in a.batches) if "eager" not in label else ""
                notes = [f"tokens {'equal' if same else 'DIFFER'}"]
                if ratios:
                    notes.append(f"x eager {ratios}")
                if "collectives_share" in r["decode"]:
                    notes.append(f"collectives {r['decode']['collectives_share']:.0%} of a "
                                 f"b{max(a.batches)} call")
                print(f"{name:<8} {label:<30} {r['load_s']:>7.2f} {r['peak_mb']:>8.0f} "
                      + " ".join(f"{r['decode'][str(b)]['tps']:>11.1f}" for b in a.batches)
                      + "  " + "; ".join(notes), flush=True)
            pair = _child(dtensor_py, "side-by-side", path, tokenizer, a)
            if "error" in pair:
                print(f"{name:<8} {'side by side, 1 process':<30} {pair['error']}")
            else:
                print(f"{name:<8} side by side in 1 process (dtensor runtime / transformers "
                      "eager, decode ms per step, median of 5 alternating pairs): "
                      + "; ".join(f"b{b} {pair[str(b)]['ours_ms']:.1f} / "
                                  f"{pair[str(b)]['eager_ms']:.1f} = x eager "
                                  f"{pair[str(b)]['eager_ms'] / pair[str(b)]['ours_ms']:.2f}"
                                  for b in a.batches), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
