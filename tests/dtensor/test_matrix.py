"""The dtensor runtime on 8 gloo processes, against plain transformers on the CPU.

Six architectures from transformers' own config classes with only the sizes shrunk
(AutoXLA/testing/architectures.py), under every strategy: each rank's placements and blocks are
the plan's, it read exactly its blocks' bytes, the logits, the loss and every gradient equal
transformers', and 16 greedy tokens are transformers' tokens. One launch runs the whole matrix
(starting 8 processes costs ~10 s of imports on 2 cores); each case is its own test here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from AutoXLA.runtimes.dtensor.launch import launch
from AutoXLA.testing.architectures import save_checkpoint
from tests.dtensor.matrix_worker import reference
from tests.helpers import SQNR_FLOOR_DB

RANKS = 8
STRATEGIES = ("fsdp", "dp", "mp", "2d", "3d")
# name -> the architecture and what is overridden beyond the shrunk sizes
ARCHITECTURES = {
    "llama": ("Llama", {}),
    "qwen3": ("Qwen3", {}),
    "gemma2": ("Gemma 2", {}),
    "mistral": ("Mistral", dict(sliding_window=6)),   # a window shorter than the 12-token prompt
    "gpt2": ("GPT-2", {}),
    "mixtral": ("Mixtral", {}),
}
# Fused projections (q, k and v in one linear, gate and up in another) under the strategies
# that split "model": their modules compute whole on this runtime (execute.py)
FUSED = {"phi3": ("Phi-3", {}, ("mp", "2d"))}
CASES = [(a, s) for a in ARCHITECTURES for s in STRATEGIES] + [
    (a, s) for a, (_, _, strategies) in FUSED.items() for s in strategies]
# Quantized, int8 and int4, every architecture under every strategy: whole linears (fsdp, dp),
# row linears split over 8 ranks (mp: more ranks than int4's blocks of 32 in these 64-wide
# layers, so each rank dequantizes its columns with their blocks' scales), both split (2d, 3d);
# each layout quantized per rank: Qwen3's and Gemma 2's norms, Gemma 2's soft-caps, Mistral's
# window, GPT-2's Conv1D weights stored (in, out), Mixtral's experts split over fsdp.
QUANTIZED = [(a, s, bits) for a in ARCHITECTURES for s in STRATEGIES for bits in (8, 4)]
# W8A8 (int8 weights and activations, torch._int_mm): mp splits every row linear's input
# features over 8 ranks, whose per-row activation scales must be the whole row's.
W8A8 = [("llama", "mp")]
# A quantized checkpoint on disk, written by `autoxla quantize` (byte for byte what the xla
# runtime's save_pretrained writes: tests/quantization/test_offline.py), loaded as it is
SAVED = [("llama", s, 4) for s in ("2d", "mp")] + [("mixtral", "2d", 8), ("gpt2", "2d", 8)]
# fp32 on both sides: the only differences are summation orders (row-parallel sums over "model",
# other GEMM blockings for other batch splits), measured below 1e-5 on logits of scale ~1.
LOGITS_RTOL = 1e-4
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def matrix_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtensor-checkpoints")
    every = list(ARCHITECTURES.items()) + [(n, (a, o)) for n, (a, o, _) in FUSED.items()]
    return {name: str(save_checkpoint(arch, root / name, seed=i, **overrides))
            for i, (name, (arch, overrides)) in enumerate(every)}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, matrix_checkpoints):
    root = tmp_path_factory.mktemp("dtensor")
    saved = {(a, bits): _quantize(matrix_checkpoints[a], root / f"{a}-int{bits}", bits)
             for a, bits in sorted({(a, bits) for a, _, bits in SAVED})}
    # transformers' reference of each model, once here rather than on each of the 8 ranks
    # (which took ~15 s of the ranks' time per model on 2 cores)
    references = {}
    for name, path in matrix_checkpoints.items():
        references[name] = str(root / f"{name}-reference.pt")
        torch.save(reference(path), references[name])
    cases = [dict(name=name, checkpoint=path, reference=references[name],
                  strategies=list(FUSED[name][2] if name in FUSED else STRATEGIES),
                  quantized=[(s, bits, None, False) for a, s, bits in QUANTIZED if a == name]
                  + [(s, bits, saved[name, bits], False) for a, s, bits in SAVED if a == name]
                  + [(s, 8, None, True) for a, s in W8A8 if a == name])
             for name, path in matrix_checkpoints.items()]
    out = root / "results"
    out.mkdir()
    worker = os.path.join(os.path.dirname(__file__), "matrix_worker.py")
    codes = launch(RANKS, [worker, str(out), json.dumps(cases)], timeout=1500)
    assert codes == [0] * RANKS, f"the ranks exited with {codes} (their output is above)"

    def results(name, strategy):
        return [json.loads((out / f"{name}-{strategy}-{r}.json").read_text()) for r in range(RANKS)]
    return results


def _quantize(source: str, target, bits: int) -> str:
    args = ["--bits", str(bits), "--no-search"] + (["--block-size", "-1"] if bits == 8 else [])
    out = subprocess.run([sys.executable, "-m", "AutoXLA.cli", "quantize", source, str(target),
                          *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return str(target)


@pytest.mark.parametrize("name,strategy", CASES)
def test_equals_transformers(matrix, name, strategy):
    for rank, r in enumerate(matrix(name, strategy)):
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["wrong_layout"] == [], f"rank {rank}: {r['wrong_layout'][:3]}"
        assert r["bytes_read"] == r["expected_bytes"], f"rank {rank} read {r['bytes_read']} bytes"
        assert r["logits_diff"] <= LOGITS_RTOL * r["logits_scale"], (rank, r["logits_diff"])
        assert abs(r["loss"] - r["reference_loss"]) <= 1e-5 * abs(r["reference_loss"]), rank
        assert r["wrong_grads"] == [], f"rank {rank}: {r['wrong_grads'][:3]}"
        assert r["grad_diff"] <= GRAD_RTOL * r["grad_scale"], (rank, r["grad_diff"], r["grad_scale"])
        assert r["tokens_equal"], f"rank {rank}: {r['tokens']} != {r['reference_tokens']}"


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_the_plan_is_the_xla_runtimes(matrix, matrix_checkpoints, name):
    # The plan the ranks ran is the one `autoxla plan` and the xla runtime's from_pretrained
    # assemble (modeling/pipeline.py plan_for_mesh) for 8 devices: equal JSON
    from AutoXLA.modeling.from_config import plan_from_config

    for strategy in STRATEGIES:
        ran = matrix(name, strategy)[0]["plan"]
        planned = plan_from_config(matrix_checkpoints[name], strategy, RANKS, dtype="float32",
                                   scan_layers=False, on_tpu=False)
        assert ran == planned.to_json(), f"{name} {strategy}"


@pytest.mark.parametrize("name,strategy,bits,label",
                         [q + (f"int{q[2]}",) for q in QUANTIZED]
                         + [q + (f"int{q[2]}-saved",) for q in SAVED])
def test_quantized_equals_the_round_tripped_reference(matrix, name, strategy, bits, label):
    # The reference is transformers with each quantized weight replaced by its round trip
    # (tests/reference_quant.py, the C core's arithmetic in plain torch), so routing decisions
    # match too and the logits agree to fp32 summation order (the float cases' tolerance)
    for rank, r in enumerate(matrix(name, f"{strategy}-{label}")):
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["wrong_layout"] == [], f"rank {rank}: {r['wrong_layout'][:3]}"
        assert r["logits_diff"] <= LOGITS_RTOL * r["logits_scale"], (rank, r["logits_diff"])
        # And the project's floors against the float model (tests/helpers.py), where they measure
        # quantization: in the tiny Mixtral a router's top-k flip on a near tie dominates (15 dB
        # int8 here, as on the xla runtime: tests/modeling/test_architectures.py)
        if name != "mixtral":
            assert r["sqnr_db"] >= SQNR_FLOOR_DB[bits], (rank, r["sqnr_db"])


@pytest.mark.parametrize("name,strategy", W8A8)
def test_w8a8_equals_torch_xlas_arithmetic(matrix, name, strategy):
    # Against transformers whose linears quantize each activation row over the whole row as
    # torch_xla's op does (tests/reference_quant.py w8a8_reference). Only fp32 summation order
    # differs, which can move a value across a rounding boundary now and then (one integer
    # step of one activation): measured 134 dB; per-rank scales (each rank's own slice's
    # maximum instead of the row's, the all-reduce left out) measured 33 dB
    for rank, r in enumerate(matrix(name, f"{strategy}-w8a8")):
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["backends"] == ["torch_int8"], (rank, r["backends"])
        assert r["wrong_layout"] == [], f"rank {rank}: {r['wrong_layout'][:3]}"
        assert r["reference_sqnr_db"] >= 80, (rank, r["reference_sqnr_db"])
        assert r["sqnr_db"] >= SQNR_FLOOR_DB[8], (rank, r["sqnr_db"])
