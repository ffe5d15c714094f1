"""A generate call on the dtensor runtime runs its modules without the executor's hooks where
their tensors stay as they are for the call (bench/runtimes.py: ~2 % of a one-process decode
step), and gives them back afterwards: see hooks_worker.py."""
from __future__ import annotations

import json
import os

from AutoXLA.runtimes.dtensor.launch import launch
from AutoXLA.testing.architectures import save_checkpoint


def test_generate_takes_the_hooks_off_for_the_call_and_gives_them_back(tmp_path):
    checkpoint = str(save_checkpoint("Llama", tmp_path / "llama", seed=0))
    worker = os.path.join(os.path.dirname(__file__), "hooks_worker.py")
    assert launch(1, [worker, checkpoint, str(tmp_path)], timeout=600) == [0]
    got = json.loads((tmp_path / "hooks.json").read_text())
    # the first layer's forwards (prefill and 5 decode steps) saw only the user's own pre-hook
    assert got["during"] == [1] * 6, got["during"]
    assert got["restored"] and got["removed_then"]
    assert got["tokens_equal"]
    # the same PyTorch kernels on the same tensors in one process: equal up to the last bits
    assert abs(got["loss"] - got["reference"]) <= 1e-6 * abs(got["reference"])
    assert got["worst_grad"] <= 1e-6
    assert got["with_grads"] == got["parameters"]
