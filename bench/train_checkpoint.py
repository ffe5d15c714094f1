"""Training checkpoints at a size users save: a ~1 GB bf16 Llama (8 layers of TinyLlama's shape)
with AdamW's state, saved on fsdp, restored on 2d, exported as safetensors; against
save_pretrained of the same model in the same run.

    ./run python bench/train_checkpoint.py [--size-gb 1.0] [--dir DIR]

Two fresh processes on 8 XLA:CPU devices, one after the other:
  save:    load on fsdp, one AdamW step (gradients of ones, so the state is real and sharded),
           then TrainingCheckpoints.save (model + optimizer) and save_pretrained (model only),
           each timed; a fingerprint of every parameter and moment (the sum of its bit patterns,
           exact whatever the order) is recorded
  restore: load on 2d, AdamW's state made by one step, TrainingCheckpoints.restore, timed;
           the same fingerprints must come back (checked), then export_safetensors, timed
Reported: seconds, GB/s of what each wrote or read, and peak RSS growth of each call (the host
copies it keeps). The checkpoint is written in --dir (default: a temporary directory); page
cache warm, so this is the CPU and memory side, not the disk's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from load import _reset_peak, _status as _rss, make_checkpoint  # noqa: E402  (bench/load.py)


def _timed(fn):
    """(seconds, peak RSS growth in bytes, result) of fn()."""
    _reset_peak()
    before = _rss("VmRSS:")
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, _rss("VmHWM:") - before, result


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _child(mode: str, checkpoint: str, work: str) -> None:
    sys.path.insert(0, str(ROOT))
    from AutoXLA import backend

    backend.use_cpu_devices(8)
    backend.device()
    import torch

    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.saving.training import TrainingCheckpoints

    strategy = "fsdp" if mode == "save" else "2d"
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoint, sharding_strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():       # one step on gradients of ones: real, sharded state
        p.grad = torch.ones_like(p)
        backend.shard_like(p.grad, p)
    opt.step()
    backend.sync()
    backend.wait_for_transfers()
    saves = TrainingCheckpoints(Path(work) / "run")

    def bits(t):          # an exact, order-free fingerprint: the sum of the raw bit patterns
        t = t.detach().cpu().contiguous()
        as_int = {2: torch.int16, 4: torch.int32}[t.element_size()]
        return int(t.view(as_int).to(torch.int64).sum())

    def sums():
        backend.sync()
        state = sorted(opt.state_dict()["state"].items())       # by parameter index
        return {"params": [bits(p) for p in model.parameters()],
                "exp_avg": [bits(s["exp_avg"]) for _, s in state],
                "exp_avg_sq": [bits(s["exp_avg_sq"]) for _, s in state]}

    out = {}
    if mode == "save":
        out["save_s"], out["save_rss"], _ = _timed(lambda: saves.save(1, model, opt))
        out["save_bytes"] = _du(saves.path(1))
        target = Path(work) / "pretrained"
        out["pretrained_s"], out["pretrained_rss"], _ = _timed(
            lambda: model.save_pretrained(target))
        out["pretrained_bytes"] = _du(target)
        out["sums"] = sums()
    else:
        out["restore_s"], out["restore_rss"], _ = _timed(lambda: saves.restore(model, opt))
        out["sums"] = sums()
        export = Path(work) / "export"
        out["export_s"], out["export_rss"], _ = _timed(lambda: saves.export_safetensors(export))
        out["export_bytes"] = _du(export)
    print("RESULT " + json.dumps(out))


def _run(mode: str, checkpoint: Path, work: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, __file__, "--child", mode, str(checkpoint), str(work)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return _child(*sys.argv[2:5])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="autoxla-train-ckpt-"))
    checkpoint, work = root / "checkpoint", root / "work"
    if not (checkpoint / "config.json").exists():
        make_checkpoint(checkpoint, args.size_gb)
    from AutoXLA.loading.checkpoint import locate

    model_bytes = sum(r.nbytes for r in locate(checkpoint).records.values())
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    saved = _run("save", checkpoint, work)
    restored = _run("restore", checkpoint, work)
    if saved["sums"] != restored["sums"]:
        wrong = {k: sum(a != b for a, b in zip(saved["sums"][k], restored["sums"][k]))
                 for k in saved["sums"]}
        raise SystemExit(f"restore on 2d did not give back the saved state; differing tensors "
                         f"per kind: {wrong}")
    gb = 1e9
    print(f"# model {model_bytes / gb:.2f} GB bf16 on 8 XLA:CPU "
          "devices; fsdp -> 2d; page cache warm")
    rows = [("TrainingCheckpoints.save (model + AdamW)", saved["save_s"], saved["save_bytes"],
             saved["save_rss"]),
            ("save_pretrained (model only)", saved["pretrained_s"], saved["pretrained_bytes"],
             saved["pretrained_rss"]),
            ("TrainingCheckpoints.restore onto 2d", restored["restore_s"], saved["save_bytes"],
             restored["restore_rss"]),
            ("export_safetensors (model only)", restored["export_s"], restored["export_bytes"],
             restored["export_rss"])]
    print(f"{'':42} {'s':>7} {'GB':>6} {'GB/s':>6} {'peak RSS +GB':>12}")
    for name, s, b, rss in rows:
        print(f"{name:42} {s:7.2f} {b / gb:6.2f} {b / gb / s:6.2f} {rss / gb:12.2f}")
    per_byte = (saved["save_s"] / saved["save_bytes"]) / (
        saved["pretrained_s"] / saved["pretrained_bytes"])
    print(f"save per byte vs save_pretrained: {per_byte:.2f}x; restored fingerprints equal: yes")


if __name__ == "__main__":
    main()
