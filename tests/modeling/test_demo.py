"""The README's main job (`./run demo`) runs end to end on the real model and passes its checks;
`autoxla generate` streams the same model's answer from a fresh interpreter."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_passes(smollm2, xla_devices, capsys):
    from AutoXLA.cli.demo import run_demo

    assert run_demo(smollm2.parent, strategy="2d")
    out = capsys.readouterr().out
    assert "answer: The ocean is" in out                       # real text, from a real model
    assert "OK: sharded generation equals plain transformers, token for token" in out
    assert "OK: splash_attention (portable blockwise path) generates eager's tokens" in out
    assert "OK: int8 logits SQNR" in out


def test_autoxla_generate_streams_the_answer(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from AutoXLA.testing.real_model import chat_prompt

    prompt = "What is the capital of France?"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8",
               TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-m", "AutoXLA.cli", "generate", str(smollm2),
                          "--prompt", prompt, "--strategy", "fsdp", "--max-new-tokens", "16"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("plan: LlamaForCausalLM: strategy fsdp")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    ids = tokenizer(chat_prompt(tokenizer, prompt), return_tensors="pt")
    reference = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    expected = reference.generate(**ids, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(expected[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip() and text.strip() in out.stdout, (text, out.stdout)
    summary = next(l for l in lines if l.startswith("summary:"))
    assert "2 programs compiled" in summary and "decode" in summary and "tokens/s" in summary
