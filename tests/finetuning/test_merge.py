"""A saved LoRA adapter merged into its base checkpoint on the host (``merge_checkpoint``,
``autoxla merge``; training/merge.py): no devices, one weight at a time.

The reference is peft's own merge (``merge_and_unload``) of the same adapter on the same
checkpoint in plain transformers on the CPU. Checked: the merged float checkpoint holds peft's
merged weights bit for bit (fp32; peft's scalings for alpha, rsLoRA and a per-module rank), and
gives the unmerged peft model's logits; merged with --bits it is byte for byte what `autoxla
quantize` makes of the float merge; what cannot merge is refused by name before anything is
written."""
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from AutoXLA.cli import main as autoxla
from AutoXLA.modeling.offline import quantize_checkpoint
from AutoXLA.quantization import QuantizationConfig
from AutoXLA.testing.tiny import save_tiny_checkpoint
from AutoXLA.training.merge import merge_checkpoint

from ..helpers import seed_lora_adapters

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tensors(directory) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("merge") / "base", seed=3)


def _adapter(base, directory, config: LoraConfig):
    """An adapter saved by plain peft (B seeded non-zero: the merge changes every target), and
    peft's merged model of it."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    seed_lora_adapters(model)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("kind", ["alpha", "rslora", "patterns", "lm_head"])
def test_the_merged_checkpoint_holds_peft_merged_weights(kind, base, tmp_path):
    targets = TARGETS + ["lm_head"] if kind == "lm_head" else TARGETS
    config = dict(alpha=LoraConfig(r=8, lora_alpha=16, target_modules=targets),
                  rslora=LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=targets),
                  patterns=LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                      rank_pattern={"down_proj": 2}, alpha_pattern={"q_proj": 4}),
                  # peft saves the head's whole weight beside its adapter
                  lm_head=LoraConfig(r=8, lora_alpha=16, target_modules=targets))[kind]
    peft_model = _adapter(base, tmp_path / "adapter", config)
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits = peft_model.eval()(input_ids=ids).logits
    want = peft_model.merge_and_unload().state_dict()

    out = merge_checkpoint(base, tmp_path / "adapter", tmp_path / "merged", progress=False)
    got = _tensors(out)
    before = _tensors(base)
    # fp32: the same W + (B @ A) * scaling as peft computes it, so the same bits
    assert set(got) == set(before)
    changed = [n for n in got if not torch.equal(got[n], before[n])]
    assert sorted(changed) == sorted([f"model.layers.{i}.{p}.{t}.weight" for i in range(2)
                                      for p, ts in (("self_attn", TARGETS[:4]),
                                                    ("mlp", TARGETS[4:])) for t in ts]
                                     + (["lm_head.weight"] if kind == "lm_head" else []))
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():           # fp32, the adapter merged vs applied beside: summation order
        torch.testing.assert_close(merged(input_ids=ids).logits, want_logits, rtol=1e-5,
                                   atol=1e-5)
    assert (out / "tokenizer.json").is_file() == (base / "tokenizer.json").is_file()


def test_merged_with_bits_is_autoxla_quantize_of_the_float_merge(base, tmp_path):
    _adapter(base, tmp_path / "adapter", LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    config = QuantizationConfig(bits=4, block_size=32)
    float_merge = merge_checkpoint(base, tmp_path / "adapter", tmp_path / "float", progress=False)
    want = _tensors(quantize_checkpoint(float_merge, tmp_path / "quantized", config,
                                        progress=False))
    # the CLI, as users run it
    assert autoxla(["merge", str(base), str(tmp_path / "adapter"), str(tmp_path / "merged"),
                     "--bits", "4", "--block-size", "32", "--quiet"]) == 0
    got = _tensors(tmp_path / "merged")
    assert set(got) == set(want) and any(t.dtype == torch.uint8 for t in got.values())
    assert all(torch.equal(got[n], want[n]) for n in want)
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert saved["quantization_config"]["n_bits"] == 4


def test_what_cannot_merge_is_refused_by_name_before_writing(base, tmp_path, capsys):
    adapter = tmp_path / "adapter"
    _adapter(base, adapter, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))

    def refused(args, match):
        out = tmp_path / "out"
        capsys.readouterr()                       # what building the fixtures printed
        assert autoxla(["merge", *map(str, args), str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("autoxla: error:") and len(err.splitlines()) == 1, err
        assert match in err, err
        assert not out.exists() or not any(out.iterdir()), "something was written"

    # an adapter made for a model of another size: the tensor named
    other = save_tiny_checkpoint("llama", tmp_path / "other", seed=0, intermediate_size=96)
    refused([other, adapter], "model.layers.0.mlp.down_proj.weight is [64, 96], the update to "
                              "it is [64, 128]: made for a model of another size")
    # a quantized checkpoint cannot take a float update: the float one can
    quantize_checkpoint(base, tmp_path / "q8", QuantizationConfig(bits=8), progress=False)
    refused([tmp_path / "q8", adapter], "merge into the float checkpoint it was quantized from")
    # an adapter on a tensor the checkpoint does not store (lm_head, tied to the embeddings)
    tied = save_tiny_checkpoint("llama", tmp_path / "tied", seed=0, tie_word_embeddings=True)
    get_peft_model(AutoModelForCausalLM.from_pretrained(tied), LoraConfig(
        r=4, target_modules=["lm_head"])).save_pretrained(tmp_path / "head")
    refused([tied, tmp_path / "head"], "has no weight lm_head.weight to update (tied")
    # a file with a B missing, DoRA, and a directory that is no adapter
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    gone = next(k for k in sorted(tensors) if "lora_B" in k)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != gone}, broken / "adapter_model.safetensors")
    refused([base, broken], "has lora_A but no lora_B for model.layers.0")
    dora = json.loads((adapter / "adapter_config.json").read_text())
    dora["use_dora"] = True
    (broken / "adapter_config.json").write_text(json.dumps(dora))
    refused([base, broken], "use_dora")
    refused([base, tmp_path], "has no adapter_config.json")
    # into a checkpoint already there: refused, then replaced with --overwrite
    assert autoxla(["merge", str(base), str(adapter), str(tmp_path / "twice"), "--quiet"]) == 0
    refused_into = tmp_path / "twice"
    capsys.readouterr()
    assert autoxla(["merge", str(base), str(adapter), str(refused_into)]) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    assert autoxla(["merge", str(base), str(adapter), str(refused_into), "--overwrite",
                    "--quiet"]) == 0
    # the format's options without --bits
    refused([base, adapter, "--block-size", "32"], "--block-size describes a quantization format")


def test_streams_in_bounded_memory_without_xla(tmp_path):
    """`autoxla merge` holds the adapter and about two weights at a time, never the model, and
    imports no torch_xla (the command `autoxla quantize`'s memory test runs, on a merge)."""
    from ..quantization.test_offline import _run

    # 8 MiB float32 MLP weights (64 x 32768) in several shards, against a baseline of the same
    # command on the tiny sizes (the same imports, empty model and plan)
    big = save_tiny_checkpoint("llama", tmp_path / "big", intermediate_size=32768,
                               max_shard_size="10MB")
    small = save_tiny_checkpoint("llama", tmp_path / "small")
    mlp = LoraConfig(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"])
    _adapter(big, tmp_path / "big_adapter", mlp)
    _adapter(small, tmp_path / "small_adapter", mlp)
    r0, base = _run("merge", small, tmp_path / "small_adapter", tmp_path / "m0", "--quiet")
    r1, peak = _run("merge", big, tmp_path / "big_adapter", tmp_path / "m1", "--quiet")
    assert base and peak, (r0.stderr[-2000:], r1.stderr[-2000:])
    assert base["rc"] == peak["rc"] == 0 and not base["xla"] and not peak["xla"]
    largest = 64 * 32768 * 4
    adapter = (tmp_path / "big_adapter" / "adapter_model.safetensors").stat().st_size
    assert sum(f.stat().st_size for f in big.glob("*.safetensors")) > 6 * largest
    # One weight read whole in float32 with its update made a block of rows at a time (1 MiB),
    # and the adapter (safetensors reads it through a mapping and copies it: twice its size while
    # read); a second weight's worth and 4 MiB for malloc's arena, page rounding and the
    # interpreter's jitter (as for autoxla quantize): 32 MiB. Holding the model's 48 MiB of MLP
    # weights fails this, and so did making each update whole beside its weight (38 MiB).
    grew = peak["hwm"] - base["hwm"]
    print(f"peak RSS grew {grew / 2**20:.1f} MiB; largest tensor {largest / 2**20:.0f} MiB, "
          f"adapter {adapter / 2**20:.1f} MiB")
    assert grew <= 2 * largest + 2 * adapter + 4 * 2**20, (peak, base)
