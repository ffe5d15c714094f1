"""`autoxla doctor --selftest`: a tiny Llama through every Pallas path AutoXLA has, against eager.

On a TPU the real kernels run; elsewhere the emulated ones (kernels/interpret.py, which needs the
JAX stack). Each path reports whether its kernel actually ran (a call counter on AutoXLA's call
site, so a silent switch to another path fails the check) and its largest logit difference from
the reference, against a tolerance:
- attention (flash, splash) against transformers' eager attention on the CPU, fp32: 1e-4, the
  project's logits tolerance (both compute the same softmax; only the summation order differs);
- the int8 matmul (int8, int4 weight-only) against the dequantize+matmul fallback on the same
  device: 1e-4 (the same integer weights, scaled before or after the product); W8A8 against
  torch_xla's XLA quantized matmul: 2e-3 (activation rows rounded to int8 may differ by a step).
"""
from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time

import torch

from .. import backend
from ..attention import tpu
from ..kernels import interpret
from ..modeling import AutoXLAModelForCausalLM
from ..quantization import QuantizationConfig
from ..testing.tiny import save_tiny_checkpoint


@dataclasses.dataclass
class Check:
    path: str
    ran: int                 # kernel calls traced
    max_abs_err: float
    tolerance: float
    seconds: float

    @property
    def ok(self) -> bool:
        return self.ran > 0 and self.max_abs_err <= self.tolerance


@contextlib.contextmanager
def _counting(module, name: str, counter: list):
    real = getattr(module, name)

    def counted(*args, **kwargs):
        counter.append(1)
        return real(*args, **kwargs)
    setattr(module, name, counted)
    try:
        yield
    finally:
        setattr(module, name, real)


def run() -> tuple[str, list[Check]]:
    """(where the kernels ran, one Check per path)."""
    backend.ensure_spmd()
    if backend.on_tpu():
        where = f"TPU v{backend.tpu_generation()} (real Pallas kernels)"
    else:
        interpret.enable()
        where = f"{backend.device_count()} CPU devices (Pallas interpret mode)"
    dev = backend.device()
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_checkpoint("llama", tmp, seed=0)
        from transformers import AutoModelForCausalLM

        eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        with torch.no_grad():
            reference = eager(input_ids=ids).logits

        def logits(**kwargs):
            model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="fsdp",
                                                            **kwargs)
            with torch.no_grad():
                return model(input_ids=ids.to(dev)).logits.cpu()

        for kernel, site in (("xla_flash_attention", "run_flash"),
                             ("splash_attention", "run_splash")):
            calls, start = [], time.perf_counter()
            with _counting(tpu, site, calls):
                got = logits(attn_implementation=kernel)
            checks.append(Check(kernel, len(calls), (got - reference).abs().max().item(), 1e-4,
                                time.perf_counter() - start))
        for name, quant, other, tol in (
                ("int8 matmul", dict(bits=8), dict(backend="fallback"), 1e-4),
                ("int4 matmul", dict(bits=4, block_size=-1), dict(backend="fallback"), 1e-4),
                ("W8A8 matmul", dict(bits=8, quantize_activation=True), dict(backend="xla_op"),
                 2e-3)):
            calls, start = [], time.perf_counter()
            with _counting(backend, "pallas_quantized_matmul", calls):
                got = logits(do_quant=True,
                             quantization_config=QuantizationConfig(use_pallas=True, **quant))
            expected = logits(do_quant=True, quantization_config=QuantizationConfig(**quant,
                                                                                    **other))
            checks.append(Check(name, len(calls), (got - expected).abs().max().item(), tol,
                                time.perf_counter() - start))
    return where, checks


def describe(where: str, checks: list[Check]) -> str:
    lines = [f"Pallas self-test on {where}"]
    for c in checks:
        verdict = "PASS" if c.ok else "FAIL"
        ran = f"{c.ran} kernel call(s) traced" if c.ran else "the kernel never ran"
        lines.append(f"  {verdict}  {c.path:20s} max |diff| {c.max_abs_err:.2e} (tolerance "
                     f"{c.tolerance:.0e}), {ran}, {c.seconds:.1f} s")
    return "\n".join(lines)
