"""`autoxla plan` over every shipped config, offline and without torch_xla: seconds per call.

    PYTHONPATH=$PWD python bench/plan_speed.py [--goal 2.0]

In this interpreter, which refuses to import torch_xla: every shipped config once, the TPU presets
in turn, decoder LMs forecast for training or inference; each call timed after one warm-up call
(the first pays for importing transformers' model code). Prints one line per call (seconds, then
the command) and the slowest against the goal (2 s: a planning question should answer at once).
tests/planning/test_topology_and_configs.py runs this script for what it checks (every config
plans, torch_xla never imported) with a hang guard, not the goal: timings belong to benches.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time


class _RefuseTorchXLA:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch_xla":
            raise ImportError("autoxla plan must not import torch_xla")


PRESETS = ["v4-8", "v5e-8", "v5e-16", "v5e-256", "v5p-128", "v6e-8", "v6e-256", "v5p-64"]


def _plan(argv: list[str]) -> float:
    from AutoXLA.cli import main

    out = io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"autoxla {' '.join(argv)} exited with {rc}")
    return time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--goal", type=float, default=2.0, help="seconds per call (default 2)")
    args = parser.parse_args()
    sys.meta_path.insert(0, _RefuseTorchXLA())
    from AutoXLA.planning.model_configs import shipped_ids

    _plan(["plan", "meta-llama/Llama-2-7b-hf", "--json"])    # warm-up: transformers' imports
    slowest = (0.0, "")
    for i, hub in enumerate(shipped_ids()):
        argv = ["plan", hub, "--topology", PRESETS[i % len(PRESETS)], "--json"]
        if not any(k in hub for k in ("sam", "segformer", "mask2former")):
            argv += ["--train", "--batch", "256", "--seq", "2048"] if i % 2 else \
                    ["--infer", "--batch", "256", "--max-len", "4096", "--dtype", "bf16"]
        seconds = _plan(argv)
        print(f"{seconds:.3f} {' '.join(argv[1:])}", flush=True)
        slowest = max(slowest, (seconds, " ".join(argv[1:])))
    assert "torch_xla" not in sys.modules, "a plan imported torch_xla"
    verdict = "within" if slowest[0] < args.goal else "OVER"
    print(f"slowest: {slowest[0]:.3f} s ({slowest[1]}), {verdict} the {args.goal:g} s goal",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
