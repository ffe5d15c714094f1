"""What AutoXLA produces, written to a folder so that two versions can be compared byte for byte:
the guard for restructurings that must not change behaviour (issue 28).

    ./run python tools/behaviour_snapshot.py write OUT      # at the old commit, then the new
    ./run python tools/behaviour_snapshot.py compare OLD NEW

`write` builds small checkpoints with fixed seeds (the tiny Llama, the shrunk Mixtral with one
tensor per expert), then records into OUT/outputs/:
- `autoxla plan` for each checkpoint under several strategies, bit widths, the KV cache and the
  forecasts, as JSON and as the table (the checkpoint's path is relative, so runs compare);
- the files `save_pretrained` writes after `from_pretrained` (float and int8, fsdp and 2d), and
  the files `autoxla quantize` writes (int8 and int4);
- the messages of errors users meet (a missing path, an unknown strategy, a bad bit width, a
  checkpoint with a missing tensor), with the command's exit status.
`compare` lists every file that differs or exists on one side only, and exits 1 if any does.
Runs on 8 virtual XLA:CPU devices in about two minutes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLANS = [  # (checkpoint, arguments of `autoxla plan`)
    ("llama", ["--json"]),
    ("llama", []),
    ("llama", ["--json", "--strategy", "2d"]),
    ("llama", ["--json", "--strategy", "3d", "--bits", "4"]),
    ("llama", ["--json", "--bits", "8", "--cpu", "--batch", "2", "--max-len", "64", "--infer"]),
    ("llama", ["--json", "--no-scan", "--train", "--batch", "2", "--seq", "32"]),
    ("llama", ["--strategy", "mp", "--comm", "--batch", "2", "--max-len", "64"]),
    ("mixtral", ["--json"]),
    ("mixtral", ["--json", "--strategy", "2d", "--bits", "4"]),
]
QUANTIZE = [("llama", ["--bits", "8"]), ("llama", ["--bits", "4"]), ("mixtral", ["--bits", "8"])]
ERRORS = [  # arguments of `autoxla`, run in OUT
    ["plan", "does-not-exist"],
    ["plan", "checkpoints/llama", "--strategy", "4d"],
    ["plan", "checkpoints/llama", "--bits", "3"],
    ["quantize", "checkpoints/broken", "broken-int8", "--bits", "8"],
]
SAVES = [  # (checkpoint, keyword arguments of from_pretrained)
    ("llama", {"sharding_strategy": "fsdp"}),
    ("llama", {"sharding_strategy": "2d", "do_quant": True}),
    ("mixtral", {"sharding_strategy": "fsdp", "do_quant": True}),
]


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "AutoXLA.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def _checkpoints(out: Path) -> None:
    from safetensors.torch import load_file, save_file

    from AutoXLA.testing.architectures import save_checkpoint
    from AutoXLA.testing.tiny import save_tiny_checkpoint

    ckpt = out / "checkpoints"
    save_tiny_checkpoint("llama", ckpt / "llama", seed=0)
    save_checkpoint("Mixtral", ckpt / "mixtral", seed=0)
    shutil.copytree(ckpt / "llama", ckpt / "broken")
    shard = next((ckpt / "broken").glob("*.safetensors"))
    tensors = load_file(str(shard))
    tensors.pop(sorted(tensors)[0])
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _saves(out: Path, outputs: Path) -> None:
    import torch

    from AutoXLA.modeling import AutoXLAModelForCausalLM

    os.chdir(out)             # config.json records the path loaded: relative, so runs compare
    for i, (name, kwargs) in enumerate(SAVES):
        model = AutoXLAModelForCausalLM.from_pretrained(f"checkpoints/{name}",
                                                        dtype=torch.float32, **kwargs)
        model.save_pretrained(str(outputs / f"save-{i}-{name}"))
        del model


def write(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    outputs = out / "outputs"
    if outputs.exists():
        shutil.rmtree(outputs)
    outputs.mkdir()
    _checkpoints(out)
    for i, (name, args) in enumerate(PLANS):
        got = _cli(["plan", f"checkpoints/{name}", *args], out)
        (outputs / f"plan-{i}-{name}.txt").write_text(
            f"$ autoxla plan checkpoints/{name} {' '.join(args)}\nexit {got.returncode}\n"
            f"{got.stdout}\n--- stderr\n{got.stderr}")
    for i, (name, args) in enumerate(QUANTIZE):
        dst = outputs / f"quantize-{i}-{name}"
        got = _cli(["quantize", f"checkpoints/{name}", str(dst.relative_to(out)), "--quiet",
                    *args], out)
        timeless = re.sub(r" in \d+(\.\d+)? s", " in <time> s", got.stderr)
        (outputs / f"quantize-{i}-{name}.txt").write_text(f"exit {got.returncode}\n{timeless}")
    for i, args in enumerate(ERRORS):
        got = _cli(args, out)
        tail = [line for line in got.stderr.splitlines() if line.strip()][-3:]
        (outputs / f"error-{i}.txt").write_text(
            f"$ autoxla {' '.join(args)}\nexit {got.returncode}\n" + "\n".join(tail) + "\n")
    _saves(out, outputs)
    files = sorted(p for p in outputs.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(outputs)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in files}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(manifest)} files in {outputs}; manifest {out / 'manifest.json'}")
    return 0


def compare(old: Path, new: Path) -> int:
    a = json.loads((old / "manifest.json").read_text())
    b = json.loads((new / "manifest.json").read_text())
    differ = [f"differs: {k}" for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
    differ += [f"only in {old}: {k}" for k in sorted(a.keys() - b.keys())]
    differ += [f"only in {new}: {k}" for k in sorted(b.keys() - a.keys())]
    print("\n".join(differ) if differ else f"identical: {len(a)} files, byte for byte")
    return 1 if differ else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("write").add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    a = p.parse_args()
    return write(a.out.resolve()) if a.verb == "write" else compare(a.old, a.new)


if __name__ == "__main__":
    sys.exit(main())
