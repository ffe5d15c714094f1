"""peft's LoRA on the dtensor runtime in one process (a world of one): the losses of transformers
+ peft on the CPU with the same adapters (docs/finetuning.md). With several processes it is
refused by name (tests/dtensor/test_training.py)."""
from __future__ import annotations

import json
import os

from AutoXLA.runtimes.dtensor.launch import launch
from AutoXLA.testing.architectures import save_checkpoint


def test_lora_in_one_process_gives_transformers_and_peft_losses(tmp_path):
    checkpoint = str(save_checkpoint("Llama", tmp_path / "llama", seed=0))
    worker = os.path.join(os.path.dirname(__file__), "lora_worker.py")
    assert launch(1, [worker, checkpoint, str(tmp_path)], timeout=600) == [0]
    runs = json.loads((tmp_path / "lora.json").read_text())
    # the same PyTorch kernels on the same tensors in one process: equal up to the last bits
    # (the executor's hooks hand the modules the very tensors transformers would use)
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(runs["dtensor"], runs["transformers"]))
    assert runs["dtensor"][-2] < runs["dtensor"][0] - 0.01      # it trains
