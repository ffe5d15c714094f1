"""AutoXLA's fine-tuning loop (training/) and `autoxla finetune`, on a tiny Llama built from
transformers' config class with SmolLM2's real tokenizer and chat template, 8 XLA:CPU devices.

- records of the three forms tokenize with the loss on the answer only; bad lines are named;
- the batches are a function of (seed, step); each bucket is one shape;
- the loop's losses (accumulation, warm-up + cosine, held-out loss) equal a plain loop's on
  transformers + peft on the CPU; no step compiles after the first two;
- the exported adapter loads in plain transformers + peft and gives the same logits;
- `autoxla finetune` killed mid-way and run again continues with an uninterrupted run's losses.
"""
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.training import Batches, FinetuneConfig, finetune, read_records, tokenize
from AutoXLA.training.data import IGNORE, split

from ..helpers import arithmetic_chat, seed_lora_adapters, wait_for_lines

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = FinetuneConfig(steps=6, batch_size=4, grad_accum=2, lr=1e-3, warmup_steps=2,
                        buckets=(48, 64), eval_fraction=0.2, save_every=2, seed=3)
# fp32 both sides, the same batches: summation order only (~1e-7 of a loss near 11), as in
# test_lora.py; a micro-batch dropped, a schedule off by one step or the loss not divided by
# the accumulation moves a loss by > 1e-3 relative.
LOSS_RTOL = 1e-5


def _records() -> list[dict]:
    records = arithmetic_chat(20)
    records.append({"prompt": "Name a colour:", "completion": " blue"})
    records.append({"text": "The quick brown fox jumps over the lazy dog. " * 4})
    return records


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_records_tokenize_with_the_loss_on_the_answer_only(chat_checkpoint):
    _, tok = chat_checkpoint
    chat = tokenize({"messages": [{"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello there."},
                                  {"role": "user", "content": "Again"},
                                  {"role": "assistant", "content": "Hello again."}]}, tok)
    assert list(chat.ids) == tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
         {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Hello again."}],
        tokenize=True, return_dict=True)["input_ids"]
    learned = tok.decode([t for t in chat.labels if t != IGNORE])
    # both answers (with the turn's end), nothing of the user's or the template's
    assert learned == "Hello there.<|im_end|>\nHello again.<|im_end|>\n"
    pc = tokenize({"prompt": "Name a colour:", "completion": " blue"}, tok)
    answer = tok(" blue", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert [t for t in pc.labels if t != IGNORE] == answer and list(pc.ids[-len(answer):]) == answer
    text = tokenize({"text": "plain words"}, tok)
    assert text.labels == text.ids and text.ids[-1] == tok.eos_token_id


@pytest.mark.parametrize("line,match", [
    ("not json", r"data.jsonl:2: not JSON"),
    ('{"messages": [{"role": "user", "content": "Hi"}]}', r"data.jsonl:2: no 'assistant'"),
    ('{"prompt": "a"}', r"data.jsonl:2: 'prompt' and 'completion' must both be strings"),
    ('{"question": "a"}', r"data.jsonl:2: a record needs 'messages'"),
    ("[1, 2]", r"data.jsonl:2: a record must be a JSON object"),
])
def test_bad_records_are_named_by_file_and_line(tmp_path, line, match):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        read_records(path)


def test_batches_are_a_function_of_seed_and_step(chat_checkpoint):
    _, tok = chat_checkpoint
    examples = [tokenize(r, tok) for r in _records()]
    one, two = (Batches(examples, 4, (48, 64), seed=3, pad_id=2) for _ in range(2))
    for i in (5, 0, 13, 5):                          # any order, across epochs
        a, b = one.batch(i), two.batch(i)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert a["input_ids"].shape[0] == 4 and a["input_ids"].shape[1] in (48, 64)
        # rows past the examples (a bucket's last batch) repeat a real one and carry no loss
        assert ((a["labels"] != IGNORE).sum(1) > 0).sum() >= 1
    assert one.batch(0)["input_ids"].tolist() != Batches(examples, 4, (48, 64), seed=4,
                                                         pad_id=2).batch(0)["input_ids"].tolist()
    epoch = [tuple(one.batch(i)["input_ids"][0].tolist()) for i in range(one.per_epoch)]
    assert len(set(epoch)) == one.per_epoch          # an epoch takes each batch once


def _plain_reference(path: str, tok) -> dict:
    """The same run written plainly on transformers + peft on the CPU."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    seed_lora_adapters(model)
    train, held = split(_records(), CONFIG.eval_fraction, CONFIG.seed)
    batches = Batches([tokenize(r, tok) for r in train], 4, CONFIG.buckets, CONFIG.seed, 2)
    evals = Batches([tokenize(r, tok) for r in held], 4, CONFIG.buckets, CONFIG.seed, 2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=CONFIG.lr)
    sched = get_cosine_schedule_with_warmup(opt, CONFIG.warmup_steps, CONFIG.steps)
    model.train()
    losses = []
    for step in range(CONFIG.steps):
        micro = [model(**batches.batch(step * 2 + k)).loss for k in range(2)]
        for loss in micro:
            (loss / 2).backward()
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(float(torch.stack(micro).detach().mean()))
    model.eval()
    total = count = 0
    with torch.no_grad():
        for i in range(evals.per_epoch):
            b = evals.batch(i)
            n = int((b["labels"][:, 1:] != IGNORE).sum())
            total, count = total + float(model(**b).loss) * n, count + n
    return dict(losses=losses, eval=total / count)


def test_the_loop_gives_a_plain_loops_losses_and_a_portable_adapter(chat_checkpoint, tmp_path,
                                                                   xla_devices):
    path, tok = chat_checkpoint
    # scanned (the default load): finetune stacks the adapters with their layers
    model = AutoXLAModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    sharding_strategy="fsdp")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    seed_lora_adapters(model)
    result = finetune(model, tok, _records(), CONFIG, tmp_path, progress=False)
    assert model.get_base_model().model.layers.last_mode == "scanned"

    want = _plain_reference(path, tok)
    losses = [r["loss"] for r in result.steps]
    assert all(abs(g - w) <= LOSS_RTOL * abs(w) for g, w in zip(losses, want["losses"])), \
        (losses, want["losses"])
    assert len(losses) == CONFIG.steps and losses[-1] < losses[0] - 0.1     # it does learn
    assert math.isclose(result.eval_losses[-1]["loss"], want["eval"], rel_tol=LOSS_RTOL)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, CONFIG.steps + 1))
    assert lines[0]["lr"] == 0.0 and lines[2]["lr"] == CONFIG.lr       # warm-up, then cosine
    assert all(x["tokens"] > 0 and x["tokens_per_s"] > 0 for x in lines)
    # One program per step shape: per bucket a first and an accumulating micro-batch's forward
    # and backward, the optimizer's first and later updates, and the step's mean loss read back;
    # the eval's forwards come after the last step. Whatever order the buckets come in, nothing
    # compiles twice (bench/finetune.py counts 7 over 60 steps of both buckets in every order).
    compiles = [x["compiles"] for x in lines]
    assert sum(compiles) <= 2 * len(CONFIG.buckets) + 3, compiles
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()
                  if p.name.startswith("step-")) == ["step-00000004", "step-00000006"]  # keep=2
    saved = json.loads((tmp_path / "checkpoints" / "step-00000006" / "autoxla-train.json")
                       .read_text())["model"]
    assert saved and all("lora_" in name for name in saved)     # the adapters, not the base

    # the adapter in peft's format, in plain transformers + peft on the CPU
    plain = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), result.adapter).eval()
    ids = torch.tensor([tok("What is 2 plus 3?")["input_ids"]])
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=ids.to(backend.device())).logits.cpu()
        theirs = plain(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)   # fp32, summation order


def _cli(args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "AutoXLA.cli", "finetune", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_run_resumes_with_the_losses_of_an_uninterrupted_one(chat_checkpoint, tmp_path):
    path, _ = chat_checkpoint
    data = _write(tmp_path / "data.jsonl", _records())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # 2 devices: resumption does not depend on the mesh (the loop's numbers on 8 are the test
    # above's), and three runs on 8 virtual devices took 3.7 minutes of the suite's longest lane.
    # Every run asks (generating first compiles programs that change how XLA lays out the
    # training step's, hence its last bits; AdamW's first update from peft's zero B turns those
    # bits into a loss ~1e-4 apart): equal runs need equal programs
    args = lambda out: [path, "--data", str(data), "--lora-rank", "4", "--steps", "8",
                        "--out", str(out), "--dtype", "fp32", "--batch-size", "4",
                        "--buckets", "48", "64", "--save-every", "3", "--lr", "1e-3",
                        "--devices", "2", "--no-progress", "--ask", "What is 2 plus 3?"]
    # the uninterrupted run also merges (after its last step: its losses are unchanged)
    whole = _cli(args(tmp_path / "whole") + ["--merge", str(tmp_path / "merged")], env)
    printed = whole.communicate(timeout=600)[0]
    assert whole.returncode == 0, printed[-3000:]
    # the question answered by the base, then by the trained adapters (the tiny model's words
    # are noise; the real model's before and after are in docs/finetuning.md)
    assert "  before: " in printed and "  after:  " in printed, printed[-3000:]
    # the merged checkpoint (merged on the host from the checkpoint's files) in plain
    # transformers gives the base + the written adapter's logits (fp32; W + B A merged vs B A
    # applied beside W: summation order only)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        assert AutoTokenizer.from_pretrained(tmp_path / "merged").chat_template
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32), str(tmp_path / "whole" / "adapter"))
        want = adapted.eval()(input_ids=ids).logits
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, want, rtol=1e-4,
                                   atol=1e-4)
        with adapted.disable_adapter():      # and the merge is visible at that tolerance
            base = adapted(input_ids=ids).logits
        assert (want - base).abs().max() > 1e-3

    killed = _cli(args(tmp_path / "killed"), env)
    # step 3 committed, steps 4 and 5 run
    wait_for_lines(killed, tmp_path / "killed" / "metrics.jsonl", 5)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    commits = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()
                     if not p.name.endswith(".partial") and p.name.startswith("step-"))
    assert commits and commits[-1] in ("step-00000003", "step-00000006")

    again = _cli(args(tmp_path / "killed"), env)
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out[-3000:]
    assert "resumed from step" in out
    # the same programs on the same inputs from the same state: equal, not merely close
    assert _losses(tmp_path / "killed") == _losses(tmp_path / "whole")
    assert len(_losses(tmp_path / "whole")) == 8


@pytest.mark.parametrize("quantized", [True, False])
def test_merge_refuses_what_it_cannot_do_before_loading(tmp_path, capsys, quantized):
    """--merge's refusals are said before anything loads, in one line, with exit code 2: into
    a directory that is not empty, and from a quantized checkpoint (its float one can take the
    update)."""
    from AutoXLA.cli.main import main

    merged, path = tmp_path / "merged", tmp_path / "ckpt"
    merged.mkdir()
    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "autoxla"}} if quantized else {}))
    if not quantized:
        (merged / "config.json").write_text("{}")
    code = main(["finetune", str(path), "--data", str(_write(tmp_path / "d.jsonl", _records())),
                 "--lora-rank", "4", "--steps", "1", "--out", str(tmp_path / "out"),
                 "--merge", str(merged)])
    err = capsys.readouterr().err
    match = "is a quantized checkpoint" if quantized else "not empty"
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and os.listdir(merged) == ([] if quantized else
                                                                      ["config.json"])
