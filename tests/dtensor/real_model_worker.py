"""One rank of the real-model check (tests/dtensor/test_real_model.py): SmolLM2-135M-Instruct,
loaded with ``runtime="dtensor"``, answers a chat prompt with 24 greedy tokens; rank 0 writes
them, transformers' on the CPU (fp32) and whether they are equal, to OUT/<strategy>-<nproc>.json."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

NEW_TOKENS = 24
PROMPT = "What is the capital of France?"


def main(checkpoint: str, strategy: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.runtimes.dtensor.process import ensure_process_group
    from AutoXLA.testing.real_model import chat_prompt

    ensure_process_group("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    inputs = tokenizer(chat_prompt(tokenizer, PROMPT), return_tensors="pt")
    args = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                max_new_tokens=NEW_TOKENS, do_sample=False)
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoint, sharding_strategy=strategy,
                                                    runtime="dtensor", dtype=torch.float32)
    with torch.no_grad():
        got = model.generate(**args)
    if dist.get_rank() == 0:
        reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        with torch.no_grad():
            want = reference.generate(**args)
        n = inputs["input_ids"].shape[1]
        result = dict(mesh=str(model.autoxla_plan.mesh), equal=bool(torch.equal(got, want)),
                      answer=tokenizer.decode(got[0, n:], skip_special_tokens=True),
                      reference=tokenizer.decode(want[0, n:], skip_special_tokens=True))
        path = os.path.join(out_dir, f"{strategy}-{dist.get_world_size()}.json")
        with open(path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
