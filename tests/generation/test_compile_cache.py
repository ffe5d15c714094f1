"""The persistent compilation cache: its self-test must tell the truth about this runtime.

Each process here is a fresh interpreter (the cache must start before anything compiles). The
second 'raw' process uses torch_xla's cache directly, bypassing AutoXLA, and reports torch_xla's
own counters: whatever the runtime does, AutoXLA's verdict must agree with them, and when the
cache works, a second process must compile nothing from scratch.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_CHILD = r"""
import json, os, sys, warnings
import torch
mode, cache, path = sys.argv[1:4]
from AutoXLA import backend
if mode == "raw":
    import torch_xla.runtime as xr
    xr.initialize_cache(cache)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from AutoXLA.modeling import AutoXLAModelForCausalLM
    model = AutoXLAModelForCausalLM.from_pretrained(
        path, sharding_strategy="2d", compile_cache=cache if mode == "autoxla" else None)
from AutoXLA.generation import compile_cache
ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
c0 = backend.compile_count()
model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
print(json.dumps({"compiled": backend.compile_count() - c0,
                  "counters": backend.persistent_cache_counters(),
                  "active": compile_cache.status().active,
                  "warned": any("compilation cache" in str(w.message) for w in caught)}))
"""


def _child(mode, cache, path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8",
               TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("AUTOXLA_COMPILE_CACHE", None)
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(cache), str(path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_self_test_verdict_matches_a_second_process(checkpoints, tmp_path):
    path = checkpoints["llama"]
    # torch_xla's cache used directly: does a second process read the first one's programs?
    raw = tmp_path / "raw"
    _child("raw", raw, path)
    second = _child("raw", raw, path)["counters"]
    reads_back = second.get("Hit", 0) > 0 and not second.get("DeserializeFailure", 0)
    # AutoXLA's option on a fresh directory: the self-test runs first.
    ours = tmp_path / "ours"
    first = _child("autoxla", ours, path)
    verdict = json.loads((ours / "autoxla-selftest.json").read_text())
    assert verdict["works"] == reads_back, (verdict, second)
    assert first["active"] == reads_back and first["warned"] == (not reads_back)
    if reads_back:
        again = _child("autoxla", ours, path)
        assert again["compiled"] == 0 and again["counters"].get("Hit", 0) >= 2, again
    else:
        # This runtime cannot read programs back (XLA:CPU in torch_xla 2.9.0): the cache stays
        # off, so nothing is written for nothing, and the second process compiles as the first.
        assert first["counters"] == {} and first["compiled"] == 2, first
        assert second.get("DeserializeFailure", 0) > 0


def test_compile_cache_too_late_is_a_warning(checkpoints, tmp_path, xla_devices):
    """Once a process has compiled a program, the option cannot apply: it says so."""
    import torch

    from AutoXLA import backend
    from AutoXLA.generation import compile_cache
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    (torch.ones(2, device=backend.device()) * 2).cpu()
    assert backend.compiled_anything()
    with pytest.warns(RuntimeWarning, match="came after this process compiled"):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], compile_cache=tmp_path / "c")
    assert not compile_cache.status().active
