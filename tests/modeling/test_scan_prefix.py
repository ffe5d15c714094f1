"""A decoder stack whose first layers differ: DeepSeek-V3's dense first layer, then its
mixture-of-experts layers. The plan scans layers 1.. as one loop and runs layer 0 unrolled before
it, as the model's own module; everything else (generation's stacked cache, saving, the unrolled
fallback) must treat the prefix as the layers it is.

The checkpoints are the coverage matrix's (AutoXLA/testing/architectures.py), with 5 layers so that the
loop has 4 steps.
"""
import pytest
import torch

from AutoXLA import backend
from AutoXLA.testing.architectures import save_checkpoint
from AutoXLA.modeling import AutoXLAModelForCausalLM
from tests.helpers import assert_close, check_sharding_matches_plan, quiet
from tests.modeling.test_architectures import IDS, NEW_TOKENS, _reference


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return save_checkpoint("DeepSeek-V3", tmp_path_factory.mktemp("deepseek") / "v3", seed=3,
                           num_hidden_layers=5)


@pytest.fixture(scope="module")
def reference(deepseek):
    return _reference(deepseek)


@pytest.fixture(scope="module")
def model(deepseek, xla_devices):
    return quiet(AutoXLAModelForCausalLM.from_pretrained, deepseek, sharding_strategy="2d")


def _logits(model, ids=IDS, **kwargs):
    with torch.no_grad():
        return model(ids.to(backend.device()), **kwargs).logits.cpu()


def test_the_plan_scans_after_the_dense_layer_and_says_why(model):
    stack = model.autoxla_plan.stack
    assert stack.scanned and (stack.start, stack.group, stack.steps) == (1, 1, 4)
    assert ("layer 0 differs from layer 1 in mlp: class DeepseekV3MLP vs DeepseekV3MoE"
            in stack.reason)
    assert stack.describe().startswith("decoder stack model.layers: layers 0..0 unrolled (")
    assert "layers 1..4 scanned as one loop of 4 steps" in str(model.autoxla_plan)
    assert model.autoxla_plan.to_dict()["stack"]["start"] == 1
    # Layer 0 is the model's own module, with its own tensors; layers 1..4 are stacked.
    layers = model.model.layers
    assert any(n.startswith("0.") for n, _ in layers.named_parameters())
    assert all(t.shape[0] == 4 for t in layers.stacked_tensors().values())
    assert check_sharding_matches_plan(model, model.autoxla_plan, model.autoxla_mesh) > 0


def test_forward_equals_transformers_with_the_loop(model, reference):
    with torch.no_grad():
        want = reference(IDS).logits
    assert_close(_logits(model), want, what="DeepSeek-V3 scanned after layer 0")
    assert model.model.layers.last_mode == "scanned"
    # The layers one by one (output_hidden_states hooks them) give the same hidden states.
    with torch.no_grad():
        got = model(IDS.to(backend.device()), output_hidden_states=True).hidden_states
        expected = reference(IDS, output_hidden_states=True).hidden_states
    assert model.model.layers.last_mode.startswith("unrolled: hooks")
    assert len(got) == len(expected) == 6
    for g, e in zip(got, expected):
        assert_close(g.cpu(), e, what="hidden states")


def test_generation_equals_transformers_and_compiles_twice(model, reference):
    dev, mask = backend.device(), torch.ones_like(IDS)
    want = quiet(reference.generate, IDS, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                 do_sample=False)
    got = quiet(model.generate, IDS.to(dev), attention_mask=mask.to(dev),
                max_new_tokens=NEW_TOKENS, do_sample=False).cpu()
    assert torch.equal(got, want), f"{got[:, -NEW_TOKENS:]} vs {want[:, -NEW_TOKENS:]}"
    assert model.model.layers.last_mode == "scanned"
    before = backend.compile_count()
    quiet(model.generate, IDS.to(dev), attention_mask=mask.to(dev), max_new_tokens=64,
          do_sample=False, eos_token_id=None)
    assert backend.compile_count() - before == 2     # prefill and decode, for any length


def test_saved_and_reloaded_gives_the_same_logits(model, reference, tmp_path):
    from safetensors import safe_open

    want = _logits(model)
    model.save_pretrained(tmp_path / "saved")
    names = set()
    for f in (tmp_path / "saved").glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            names |= set(s.keys())
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.4.mlp.gate.weight"} <= names
    assert not any("stacked" in n for n in names)
    # Each layer's tensors together, in layer order, layer 0's (a whole module) included.
    from AutoXLA.saving import saved_tensors as _tensors

    order = [int(n.split(".")[2]) for n in _tensors(model) if n.startswith("model.layers.")]
    assert order == sorted(order)
    again = quiet(AutoXLAModelForCausalLM.from_pretrained, tmp_path / "saved",
                  sharding_strategy="2d")
    assert again.autoxla_plan.stack.start == 1
    assert_close(_logits(again), want, what="reloaded DeepSeek-V3")


def test_state_dict_names_every_layer_and_loads_back(deepseek, xla_devices):
    model = quiet(AutoXLAModelForCausalLM.from_pretrained, deepseek, sharding_strategy="fsdp")
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    for i in range(5):
        assert f"model.layers.{i}.self_attn.o_proj.weight" in state
    assert not any("stacked" in k for k in state)
    before = _logits(model)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.2.self_attn.o_proj.weight"):
        state[name] = state[name] * 0
    model.load_state_dict(state)
    assert not model.model.layers[0].mlp.up_proj.weight.cpu().any()
    assert not model.model.layers[2].self_attn.o_proj.weight.cpu().any()
    assert model.model.layers[3].self_attn.o_proj.weight.cpu().any()
    assert not torch.equal(_logits(model), before)


@pytest.mark.parametrize("options", [{}, {"gradient_checkpointing": True, "use_fsdp_wrap": True}])
def test_a_training_step_equals_transformers(options, deepseek, xla_devices):
    # The scanned backward (_RematScan) hands its input's gradient to the unrolled layer 0, which
    # is checkpointed (and wrapped with the stack by FSDPv2) when asked.
    ref = _reference(deepseek).train()
    want = ref(IDS, labels=IDS).loss
    want.backward()
    model = quiet(AutoXLAModelForCausalLM.from_pretrained, deepseek, sharding_strategy="fsdp",
                  **options)
    model.train()
    dev = backend.device()
    loss = model(IDS.to(dev), labels=IDS.to(dev)).loss
    loss.backward()
    backend.sync()
    inner = getattr(model, "autoxla_module", model).model.layers
    layers = getattr(inner, "module", inner)
    assert layers.last_mode == "scanned"
    checkpointed = hasattr(layers[0], "_xla_checkpointed_forward_original")
    assert checkpointed == bool(options.get("gradient_checkpointing"))
    assert abs(loss.item() - want.item()) <= 1e-4 * abs(want.item()), (loss.item(), want.item())
    for got, expected in (
            (layers[0].mlp.down_proj.weight.grad, ref.model.layers[0].mlp.down_proj.weight.grad),
            (layers.stacked_tensors()["self_attn.o_proj.weight"].grad[1],
             ref.model.layers[2].self_attn.o_proj.weight.grad)):
        assert_close(got.cpu(), expected, atol=1e-4 * expected.abs().max().item(),
                     what="gradient")


def test_layers_that_all_differ_still_unroll_with_the_reason(tmp_path, xla_devices):
    # Two layers, dense then MoE: nothing repeats twice after any prefix.
    path = save_checkpoint("DeepSeek-V3", tmp_path / "v3", num_hidden_layers=2)
    model = quiet(AutoXLAModelForCausalLM.from_pretrained, path, sharding_strategy="2d")
    stack = model.autoxla_plan.stack
    assert not stack.scanned and stack.start == 0
    assert "do not repeat: layer 1 differs from layer 0 in mlp" in stack.reason
    assert type(model.model.layers).__name__ == "ModuleList"


def test_a_pattern_of_pairs_after_one_layer(tmp_path, batch, xla_devices):
    # 5 Gemma 2 layers (sliding, global, ...): no whole number of pairs from layer 0, so layer 0
    # runs alone and layers 1..4 as 2 steps of a (global, sliding) pair.
    from AutoXLA.testing.tiny import save_tiny_checkpoint

    ids, mask = batch
    valid = mask.bool()
    path = save_tiny_checkpoint("gemma2", tmp_path / "gemma2", seed=5, num_hidden_layers=5)
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="2d")
    stack = model.autoxla_plan.stack
    assert (stack.start, stack.group, stack.steps) == (1, 2, 2)
    assert "layers 0..4 are not whole groups of 2" in stack.reason
    got = _logits(model, ids, attention_mask=mask.to(backend.device()))
    assert model.model.layers.last_mode == "scanned"
    want = _reference(path)(input_ids=ids, attention_mask=mask).logits
    assert_close(got[valid], want[valid], what="gemma2 pairs after layer 0")
