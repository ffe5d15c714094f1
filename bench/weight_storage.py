"""Where the dtensor runtime's one-process decode gap comes from: one decode forward of SmolLM2
(transformers' DynamicCache, 20 cached tokens) for three models in one process, interleaved step
by step so that the machine's drift hits them alike:

- plain transformers, as `from_pretrained` leaves its weights;
- plain transformers with every weight cloned into a fresh allocation (nothing else changed);
- the dtensor runtime's model (one process, fsdp: its executor's hooks, its loader's tensors).

Prints each one's median ms per forward and its speed relative to the first.

    ./run dtensor bench/weight_storage.py [--batches 1 8] [--steps 60]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cloned(model):
    """``model`` with each parameter's data copied into a fresh tensor (ties restored)."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(p.detach().clone(),
                                                                  requires_grad=False)
    model.tie_weights()
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=60)
    a = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.testing.real_model import smollm2_checkpoint

    path = str(smollm2_checkpoint())
    plain = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    models = {"transformers as loaded": plain(), "transformers, weights cloned": cloned(plain()),
              "dtensor runtime, 1 process": AutoXLAModelForCausalLM.from_pretrained(
                  path, runtime="dtensor", sharding_strategy="fsdp", dtype=torch.float32)}
    print(f"SmolLM2-135M, fp32, {torch.get_num_threads()} threads; one decode forward, median "
          f"of {a.steps - 5} interleaved steps")
    for batch in a.batches:
        ids = torch.randint(100, 1000, (batch, 20), generator=torch.Generator().manual_seed(0))
        caches, times = {}, {name: [] for name in models}
        with torch.no_grad():
            for name, model in models.items():
                caches[name] = DynamicCache(config=model.config)
                model(input_ids=ids, cache=caches[name], use_cache=True)
            for _ in range(a.steps):
                for name, model in models.items():
                    t0 = time.perf_counter()
                    model(input_ids=ids[:, -1:], cache=caches[name], use_cache=True,
                          logits_to_keep=1)
                    times[name].append(time.perf_counter() - t0)
                    caches[name].crop(-1)
        first = statistics.median(times["transformers as loaded"][5:])
        for name, t in times.items():
            ms = statistics.median(t[5:])
            print(f"batch {batch:>2}  {name:<28} {1000 * ms:7.2f} ms  x{first / ms:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
