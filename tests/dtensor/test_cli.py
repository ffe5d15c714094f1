"""`autoxla generate --runtime dtensor --nproc N` in the dtensor runtime's environment: the command
starts its own processes, one per device, and rank 0 streams the answer; on the real SmolLM2 it is
transformers' greedy answer. Wrong runtime arguments are one-line errors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from AutoXLA.testing.real_model import chat_prompt, smollm2_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What is the capital of France?"


def _autoxla(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "AutoXLA.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_generate_on_two_processes_streams_transformers_answer():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(smollm2_checkpoint())
    out = _autoxla("generate", path, "--runtime", "dtensor", "--nproc", "2", "--dtype", "fp32",
                   "--prompt", PROMPT, "--max-new-tokens", "12")
    assert out.returncode == 0, out.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(chat_prompt(tokenizer, PROMPT), return_tensors="pt", add_special_tokens=False)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(want[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip() and answer.strip() in out.stdout, out.stdout
    assert "on 2 process(es) (dtensor runtime)" in out.stdout
    assert out.stdout.count("plan: ") == 1          # rank 0 alone prints


def test_the_demo_on_the_dtensor_runtime():
    # `./run demo`'s second half: SmolLM2 over 2 processes (2d), tokens equal transformers',
    # int8 above the demo's SQNR bar; rank 0 alone prints, the exit status is the checks'
    out = _autoxla("demo", "--runtime", "dtensor", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK: the dtensor runtime's generation equals plain transformers" in out.stdout, out.stdout
    assert "OK: int8 on the dtensor runtime" in out.stdout, out.stdout
    assert "on 2 process(es) (dtensor runtime, cpu)" in out.stdout
    assert out.stdout.count("plan: ") == 1


@pytest.mark.parametrize("args,message", [
    (["--runtime", "xla"], "runtime 'xla' cannot run here: torch_xla is not installed"),
    (["--runtime", "dtensor", "--nproc", "0"], "--nproc 0"),
    (["--runtime", "dtensor", "--attention", "splash_attention"], "xla-runtime options"),
])
def test_runtime_arguments_are_one_line_errors(tmp_path, args, message):
    out = _autoxla("generate", str(smollm2_checkpoint()), "--prompt", "hi", *args, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("autoxla: error:") and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_serve_says_it_runs_on_the_xla_runtime_only():
    out = _autoxla("serve", str(smollm2_checkpoint()), timeout=300)
    assert out.returncode == 2 and "autoxla serve runs on the xla runtime only" in out.stderr, \
        out.stderr[-2000:]
