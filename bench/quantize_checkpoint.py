"""`autoxla quantize` on a checkpoint of a few GB: time and peak RSS (issue 15, item 7).

    PYTHONPATH=$PWD python bench/quantize_checkpoint.py [--layers 16] [--bits 8 4] [--dir DIR]

The checkpoint (a Llama config: hidden 2048, MLP 8192, vocab 32000, bf16, 2 GB shards) is
written on the fly one tensor at a time (saving/safetensors_out.py), random normal weights; then
`autoxla quantize` runs in a fresh interpreter per bit width, and once on a tiny checkpoint of
the same architecture for the baseline RSS (interpreter, torch, transformers, the empty model).
Goal (printed as met / not met): peak RSS - baseline within two tensors of the largest.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_WRAPPER = """
import json, sys
from AutoXLA.cli import main
rc = main(sys.argv[1:])
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"rc": rc, "xla": "torch_xla" in sys.modules, "hwm": hwm * 1024}))
"""


def write_checkpoint(directory: Path, layers: int, hidden: int, mlp: int, vocab: int) -> int:
    """A bf16 Llama checkpoint of random weights, written tensor by tensor; returns the largest
    tensor's bytes."""
    import torch
    from transformers import LlamaConfig

    from AutoXLA import saving
    from AutoXLA.saving.journal import SAFE_INDEX, SAFE_SINGLE
    from AutoXLA.saving.safetensors_out import ShardWriter

    config = LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                         vocab_size=vocab, tie_word_embeddings=False, dtype="bfloat16")
    kv = config.num_key_value_heads * 64
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden),
                       p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden),
                       p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (mlp, hidden),
                       p + "mlp.up_proj.weight": (mlp, hidden),
                       p + "mlp.down_proj.weight": (hidden, mlp),
                       p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    specs = {n: (s, torch.bfloat16) for n, s in shapes.items()}
    sizes = {n: torch.Size(s).numel() * 2 for n, s in shapes.items()}
    groups = saving.shard_groups(sizes, 2 * 2**30)
    names = ([SAFE_SINGLE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    directory.mkdir(parents=True)
    writer = ShardWriter(specs, groups, [directory / n for n in names])
    g = torch.Generator().manual_seed(0)
    for n, s in shapes.items():
        writer.write(n, torch.randn(s, generator=g).mul_(0.02).to(torch.bfloat16))
    writer.close()
    if len(groups) > 1:
        weight_map = {n: f for f, grp in zip(names, groups) for n in grp}
        (directory / SAFE_INDEX).write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}))
    config.save_pretrained(directory)
    return max(sizes.values())


def run(*argv) -> tuple[dict, float]:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _WRAPPER, *map(str, argv)], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="autoxla-quantize-bench-"))
    try:
        t = time.perf_counter()
        largest = write_checkpoint(root / "src", args.layers, 2048, 8192, 32000)
        size = sum(f.stat().st_size for f in (root / "src").glob("*.safetensors"))
        print(f"checkpoint: {size / 1e9:.2f} GB bf16, {args.layers} layers, largest tensor "
              f"{largest / 2**20:.0f} MiB, written in {time.perf_counter() - t:.1f} s")
        write_checkpoint(root / "tiny", 2, 256, 512, 512)
        base, _ = run("quantize", root / "tiny", root / "tiny-q", "--bits", "8", "--quiet")
        print(f"baseline peak RSS (same command, tiny checkpoint): {base['hwm'] / 2**20:.0f} MiB")
        for bits in args.bits:
            out, seconds = run("quantize", root / "src", root / f"q{bits}", "--bits", bits,
                               "--quiet")
            grew = out["hwm"] - base["hwm"]
            qsize = sum(f.stat().st_size for f in (root / f"q{bits}").glob("*.safetensors"))
            print(f"int{bits} (defaults): {seconds:.1f} s ({size / 1e9 / seconds:.2f} GB/s of "
                  f"bf16 read), output {qsize / 1e9:.2f} GB, peak RSS {out['hwm'] / 2**20:.0f} "
                  f"MiB = baseline + {grew / 2**20:.0f} MiB = {grew / largest:.2f} x the largest "
                  f"tensor; goal <= 2: {'met' if grew <= 2 * largest else 'NOT met'}; "
                  f"torch_xla imported: {out['xla']}")
            shutil.rmtree(root / f"q{bits}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
