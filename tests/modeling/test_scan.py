"""The scanned decoder stack against the unrolled one and plain transformers.

4-layer fixtures, so that every family repeats (Gemma 2's sliding/global layers as 2 steps of a
pair). The 2-layer fixtures of the other tests run scanned too (it is the default); these tests
add the unrolled side, generation, training, quantization, the kernels, saving and the fallbacks.
"""
import pytest
import torch

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.modeling.from_config import plan_from_config
from AutoXLA.quantization import QuantizationConfig
from AutoXLA.testing.tiny import available_families, save_tiny_checkpoint
from tests.conftest import reference_loader
from tests.helpers import assert_close, check_sharding_matches_plan
from tests.modeling.test_training import _train

FAMILIES = available_families()
# Same weights, same ops, one loop instead of four copies: only fp32 summation order may differ
# between the two programs (XLA fuses the loop body separately), as between sharded and unsharded
# programs (tests/helpers.py): the same tolerance applies. Greedy tokens must be identical.
LOSS_TOL = 1e-4


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    root = tmp_path_factory.mktemp("deep")
    return {f: save_tiny_checkpoint(f, root / f, seed=10 + i, num_hidden_layers=4)
            for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def deep_reference(deep):
    return reference_loader(deep)


def _logits(model, ids, mask):
    dev = backend.device()
    with torch.no_grad():
        return model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()


@pytest.mark.parametrize("family", FAMILIES)
def test_scanned_equals_unrolled_and_transformers(family, deep, deep_reference, batch, xla_devices):
    ids, mask = batch
    valid = mask.bool()
    expected = deep_reference(family)(input_ids=ids, attention_mask=mask).logits.detach()
    scanned = AutoXLAModelForCausalLM.from_pretrained(deep[family], sharding_strategy="2d")
    stack = scanned.autoxla_plan.stack
    assert stack.scanned and stack.group == (2 if family == "gemma2" else 1)
    got = _logits(scanned, ids, mask)
    assert scanned.model.layers.last_mode == "scanned"
    assert check_sharding_matches_plan(scanned, scanned.autoxla_plan, scanned.autoxla_mesh) > 0
    unrolled = AutoXLAModelForCausalLM.from_pretrained(deep[family], sharding_strategy="2d",
                                                       scan_layers=False)
    assert type(unrolled.model.layers).__name__ == "ModuleList"
    plain = _logits(unrolled, ids, mask)
    assert_close(got[valid], expected[valid], what=f"{family} scanned vs transformers")
    assert_close(got[valid], plain[valid], what=f"{family} scanned vs unrolled")


@pytest.mark.parametrize("strategy", ["fsdp", "mp", "3d"])
def test_scanned_under_every_strategy(strategy, deep, deep_reference, batch, xla_devices):
    ids, mask = batch
    valid = mask.bool()
    expected = deep_reference("qwen3")(input_ids=ids, attention_mask=mask).logits.detach()
    model = AutoXLAModelForCausalLM.from_pretrained(deep["qwen3"], sharding_strategy=strategy)
    got = _logits(model, ids, mask)
    assert model.model.layers.last_mode == "scanned"
    assert_close(got[valid], expected[valid], what=f"qwen3 scanned under {strategy}")
    check_sharding_matches_plan(model, model.autoxla_plan, model.autoxla_mesh)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_scanned_generation_equals_transformers_and_compiles_once(family, deep, deep_reference,
                                                                  batch, xla_devices):
    # 40 tokens with the stacked static cache: every token as transformers' greedy choice, one
    # prefill and one decode program, and nothing new on a second call of another length in the
    # same buckets.
    ids, mask = batch
    args = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    model = AutoXLAModelForCausalLM.from_pretrained(deep[family], sharding_strategy="2d")
    dev = backend.device()
    before = backend.compile_count()
    got = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=40,
                         **args).cpu()
    assert backend.compile_count() - before == 2
    assert model.model.layers.last_mode == "scanned"
    expected = deep_reference(family).generate(input_ids=ids, attention_mask=mask,
                                               max_new_tokens=40, **args)
    assert torch.equal(got, expected)
    before = backend.compile_count()
    model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=25, **args)
    assert backend.compile_count() == before


@pytest.mark.parametrize("family,strategy,fsdp", [("llama", "fsdp", True), ("gemma2", "2d", False)])
def test_scanned_training_equals_unrolled(family, strategy, fsdp, deep, xla_devices):
    # Three AdamW steps: the scanned backward (a reverse loop recomputing each layer) gives the
    # unrolled model's gradients, so the losses after two updates still agree.
    runs = {}
    for scan in (True, False):
        model = AutoXLAModelForCausalLM.from_pretrained(
            deep[family], sharding_strategy=strategy, use_fsdp_wrap=fsdp,
            gradient_checkpointing=True, scan_layers=scan)
        model.train()
        runs[scan] = _train(model, 3)
        if scan:
            inner = getattr(model, "autoxla_module", model)
            assert getattr(inner.model.layers, "module", inner.model.layers).last_mode == "scanned"
    assert runs[True][2] < runs[True][0] - 0.1, runs
    for a, b in zip(runs[True], runs[False]):
        assert abs(a - b) <= 10 * LOSS_TOL, runs


@pytest.mark.parametrize("bits,block", [(8, -1), (4, 32)])
def test_scanned_quantized_equals_unrolled(bits, block, deep, batch, xla_devices):
    ids, mask = batch
    valid = mask.bool()
    cfg = dict(do_quant=True, quantization_config=QuantizationConfig(n_bits=bits, block_size=block))
    scanned = AutoXLAModelForCausalLM.from_pretrained(deep["llama"], sharding_strategy="2d", **cfg)
    unrolled = AutoXLAModelForCausalLM.from_pretrained(deep["llama"], sharding_strategy="2d",
                                                       scan_layers=False, **cfg)
    assert scanned.autoxla_plan.stack.scanned
    got = _logits(scanned, ids, mask)
    assert scanned.model.layers.last_mode == "scanned"
    assert_close(got[valid], _logits(unrolled, ids, mask)[valid], what=f"int{bits} scanned")
    # A layer still reads its own quantized weight (a slice of the stacked one).
    assert torch.equal(scanned.model.layers[2].mlp.down_proj.weight.cpu(),
                       unrolled.model.layers[2].mlp.down_proj.weight.cpu())


@pytest.mark.parametrize("kernel", ["splash_attention", "xla_flash_attention"])
def test_scanned_with_kernels(kernel, deep, deep_reference, batch, xla_devices):
    ids, mask = batch
    valid = mask.bool()
    args = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=12)
    model = AutoXLAModelForCausalLM.from_pretrained(deep["gemma2"], sharding_strategy="2d",
                                                    attn_implementation=kernel)
    reference = deep_reference("gemma2")
    got = _logits(model, ids, mask)
    assert model.model.layers.last_mode == "scanned"
    expected = reference(input_ids=ids, attention_mask=mask).logits.detach()
    assert_close(got[valid], expected[valid], what=f"gemma2 {kernel} scanned")
    dev = backend.device()
    tokens = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args).cpu()
    assert torch.equal(tokens, reference.generate(input_ids=ids, attention_mask=mask, **args))


def test_attention_on_some_layers_only_unrolls_with_the_reason(deep, xla_devices):
    model = AutoXLAModelForCausalLM.from_pretrained(
        deep["llama"], attn_implementation="splash_attention", attention_config={"layers": [0, 1]})
    stack = model.autoxla_plan.stack
    assert not stack.scanned and "autoxla_attention" in stack.reason
    assert stack.describe() in str(model.autoxla_plan)
    # What the loader ran is what `autoxla plan` previews from the config alone.
    preview = plan_from_config(deep["llama"], "fsdp", 8, attn_implementation="splash_attention",
                               attention_config={"layers": [0, 1]})
    assert (preview.stack, preview.layer_attention) == (stack, model.autoxla_plan.layer_attention)
    patched = {n for n, m in model.named_modules() if getattr(m, "autoxla_attention", None)}
    assert patched == {p for p, k in preview.layer_attention.modules.items() if k != "eager"}


def test_hidden_states_fall_back_to_the_layers_one_by_one(deep, deep_reference, batch, xla_devices):
    # output_hidden_states hooks every decoder layer: the stack then runs them one by one from
    # the stacked tensors, and every layer's hidden states are transformers'.
    ids, mask = batch
    valid = mask.bool()
    model = AutoXLAModelForCausalLM.from_pretrained(deep["llama"], sharding_strategy="fsdp")
    dev = backend.device()
    with torch.no_grad():
        got = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True)
        expected = deep_reference("llama")(input_ids=ids, attention_mask=mask,
                                           output_hidden_states=True)
    assert model.model.layers.last_mode.startswith("unrolled: hooks")
    assert len(got.hidden_states) == len(expected.hidden_states) == 5
    for g, e in zip(got.hidden_states, expected.hidden_states):
        assert_close(g.cpu()[valid], e[valid], what="hidden states")
    _logits(model, ids, mask)
    assert model.model.layers.last_mode == "scanned"     # the hooks are gone again


def test_saved_scanned_model_is_a_per_layer_checkpoint(deep, deep_reference, batch, tmp_path,
                                                       xla_devices):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ids, mask = batch
    model = AutoXLAModelForCausalLM.from_pretrained(deep["llama"], sharding_strategy="2d")
    model.save_pretrained(tmp_path / "saved")
    names = set()
    for f in (tmp_path / "saved").glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            names |= set(s.keys())
    assert "model.layers.3.mlp.down_proj.weight" in names
    assert not any("stacked" in n for n in names)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    with torch.no_grad():
        assert_close(again(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                     deep_reference("llama")(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                     what="reloaded")


def test_state_dict_has_per_layer_names_and_loads_back(deep, batch, xla_devices):
    ids, mask = batch
    model = AutoXLAModelForCausalLM.from_pretrained(deep["llama"], sharding_strategy="fsdp")
    state = model.state_dict()
    assert "model.layers.2.self_attn.o_proj.weight" in state
    assert not any("stacked" in k for k in state)
    before = _logits(model, ids, mask)
    host = {k: v.cpu() for k, v in state.items()}
    host["model.layers.1.mlp.up_proj.weight"] = host["model.layers.1.mlp.up_proj.weight"] * 0
    model.load_state_dict(host)
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight.cpu(),
                       torch.zeros_like(host["model.layers.1.mlp.up_proj.weight"]))
    assert not torch.equal(_logits(model, ids, mask), before)


def test_bad_scan_layers_and_quantizing_a_scanned_model_are_clear_errors(deep, xla_devices):
    from AutoXLA.quantization import ModelQuantizer

    with pytest.raises(TypeError, match="scan_layers must be True or False"):
        AutoXLAModelForCausalLM.from_pretrained(deep["llama"], scan_layers="yes")
    model = AutoXLAModelForCausalLM.from_pretrained(deep["llama"])
    with pytest.raises(ValueError, match="is scanned.*scan_layers=False"):
        ModelQuantizer(QuantizationConfig(n_bits=8)).quantize_model(model)
