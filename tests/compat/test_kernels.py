"""The original's patchers (AutoXLA.kernels) on a model AutoXLA loaded with eager attention: the
patched model computes what the same checkpoint loaded with the kernel computes, and what plain
transformers computes (the kernels' portable path runs off TPU, as in tests/attention)."""
import pytest
import torch

from AutoXLA import backend
from AutoXLA.attention import hf
from AutoXLA.kernels import (SplashAttentionConfig, SplashAttentionPatcher,
                             XLAFlashAttentionPatcher, apply_splash_attention,
                             apply_xla_flash_attention)
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.sharding.mesh import MeshShape
from AutoXLA.testing.tiny import available_families
from tests.helpers import assert_close

# 4-token blocks: the 12-token batch spans several blocks, so causal block skipping is exercised.
SMALL_BLOCKS = {"sa_block_q": 4, "sa_block_kv": 4}
PATCH = {
    "apply_splash_attention": lambda m: apply_splash_attention(m, **SMALL_BLOCKS),
    "SplashAttentionPatcher": lambda m: SplashAttentionPatcher(
        SplashAttentionConfig(**SMALL_BLOCKS)).patch_model(m),
    "apply_xla_flash_attention": lambda m: apply_xla_flash_attention(m, m.autoxla_mesh),
}
KERNEL = {"apply_splash_attention": "splash_attention",
          "SplashAttentionPatcher": "splash_attention",
          "apply_xla_flash_attention": "xla_flash_attention"}


def _eager(path):
    return AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="2d")


def _logits(model, ids, mask):
    dev = next(model.parameters()).device
    with torch.no_grad():
        return model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()


@pytest.fixture(scope="module")
def kernel_logits(checkpoints, batch, xla_devices):
    """kernel -> logits of llama loaded with that kernel by from_pretrained (cached)."""
    cache = {}

    def get(kernel):
        if kernel not in cache:
            model = AutoXLAModelForCausalLM.from_pretrained(
                checkpoints["llama"], sharding_strategy="2d", attn_implementation=kernel,
                attention_config=SMALL_BLOCKS if kernel == "splash_attention" else None)
            cache[kernel] = _logits(model, *batch)
        return cache[kernel]

    return get


def _spy(monkeypatch):
    """Records every call of the kernels' portable path (none means the patch did nothing)."""
    calls, real = [], hf.blockwise_attention

    def spy(*args, **kwargs):
        calls.append(dict(block_q=kwargs["block_q"], dense=kwargs["mask"] is not None,
                          softcap=kwargs["softcap"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "blockwise_attention", spy)
    return calls


@pytest.mark.parametrize("how", sorted(PATCH))
def test_patched_eager_model_equals_the_kernel_load_and_transformers(
        how, checkpoints, reference_models, batch, kernel_logits, monkeypatch):
    ids, mask = batch
    model = _eager(checkpoints["llama"])
    assert PATCH[how](model) is model
    calls = _spy(monkeypatch)
    got = _logits(model, ids, mask)
    # The kernel ran (structured mask, not a dense one), with the config's blocks; the scanned
    # stack traces its one-layer step once.
    block = SMALL_BLOCKS["sa_block_q"] if KERNEL[how] == "splash_attention" else 512
    assert calls == [dict(block_q=block, dense=False, softcap=None)]
    assert model.model.layers.last_mode == "scanned"
    valid = mask.bool()   # padded positions are outputs nobody reads
    assert_close(got[valid], kernel_logits(KERNEL[how])[valid], what=f"{how} vs from_pretrained")
    expected = reference_models("llama")(input_ids=ids, attention_mask=mask).logits.detach()
    assert_close(got[valid], expected[valid], what=f"{how} vs transformers")


def test_layer_indices_patch_only_those_layers(checkpoints, reference_models, batch, monkeypatch):
    ids, mask = batch
    model = _eager(checkpoints["llama"])
    loaded = model.autoxla_plan
    patcher = SplashAttentionPatcher(SMALL_BLOCKS, layer_indices=[1])
    patcher.patch_model(model)
    assert patcher.patched_layers == [1]
    # The loader's plan is left as it was; the model now carries one that says what changed.
    assert loaded.stack.scanned and loaded.layer_attention is None
    assert model.autoxla_plan is model.autoxla.plan is not loaded
    assert model.autoxla_plan.layer_attention.modules == {
        "model.layers.0.self_attn": "eager", "model.layers.1.self_attn": "splash_attention"}
    calls = _spy(monkeypatch)
    got = _logits(model, ids, mask)
    # Layer 0 stays eager, so the layers differ and the stack can no longer run as one loop.
    assert len(calls) == 1
    assert not model.autoxla_plan.stack.scanned
    assert model.model.layers.last_mode.startswith("unrolled")
    expected = reference_models("llama")(input_ids=ids, attention_mask=mask).logits.detach()
    assert_close(got[mask.bool()], expected[mask.bool()], what="layer 1 patched")


@pytest.mark.skipif("gemma2" not in available_families(), reason="transformers has no Gemma2")
def test_soft_cap_is_the_models_own(checkpoints, reference_models, batch, monkeypatch):
    ids, mask = batch
    model = _eager(checkpoints["gemma2"])
    cap = model.config.attn_logit_softcapping
    assert cap is not None
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        SplashAttentionPatcher(SMALL_BLOCKS, logits_soft_cap=cap / 2).patch_model(model)
    assert model.config._attn_implementation == "eager"    # refused before anything changed
    patcher = SplashAttentionPatcher.from_model_config(model, **SMALL_BLOCKS)
    assert patcher.logits_soft_cap == cap
    patcher.patch_model(model)
    calls = _spy(monkeypatch)
    got = _logits(model, ids, mask)
    assert calls and all(c["softcap"] == cap for c in calls)
    expected = reference_models("gemma2")(input_ids=ids, attention_mask=mask).logits.detach()
    assert_close(got[mask.bool()], expected[mask.bool()], what="gemma2 patched")


def test_flash_mesh_and_partition_spec(checkpoints, xla_devices):
    model = _eager(checkpoints["llama"])
    other = backend.make_mesh(MeshShape(1, xla_devices, 1))
    with pytest.raises(ValueError, match="autoxla_mesh"):
        apply_xla_flash_attention(model, other)
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="4 entries"):
        XLAFlashAttentionPatcher(model.autoxla_mesh, ("fsdp", None, None))
    # The original's (batch, heads) form, as from_pretrained's attention_partition_spec.
    short = XLAFlashAttentionPatcher(model.autoxla_mesh, ("fsdp", "mp"))
    assert short.attention_config(model).qkv_partition_spec == ("fsdp", "model", None, None)
    spec = (("data", "fsdp"), "model", None, None)
    XLAFlashAttentionPatcher(None, spec).patch_model(model)
    layer = model.model.layers[0].self_attn.autoxla_attention
    assert (layer.kernel, layer.config.qkv_partition_spec) == ("xla_flash_attention", spec)
    assert layer.mesh is model.autoxla_mesh


def test_sharded_model_is_not_copied(checkpoints):
    model = _eager(checkpoints["llama"])
    with pytest.raises(ValueError, match="inplace=True"):
        apply_splash_attention(model, inplace=False)
    assert model.config._attn_implementation == "eager"


@pytest.fixture
def cpu_llama(checkpoints):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32,
                                                attn_implementation="eager").eval()


def test_cpu_model_copy_and_the_originals_keywords(cpu_llama, batch, monkeypatch):
    ids, mask = batch
    expected = _logits(cpu_llama, ids, mask)
    with pytest.warns(UserWarning, match="mask_k"), pytest.warns(UserWarning, match="portable"):
        patched = apply_splash_attention(cpu_llama, block_size=4, mask_k=512, inplace=False)
    assert patched is not cpu_llama
    assert cpu_llama.config._attn_implementation == "eager"      # the original is untouched
    assert not any(hasattr(m, "autoxla_attention") for m in cpu_llama.modules())
    cfg = patched.model.layers[0].self_attn.autoxla_attention.config
    assert {cfg.sa_block_q, cfg.sa_block_kv, cfg.sa_block_q_dkv, cfg.sa_block_kv_dq} == {4}
    calls = _spy(monkeypatch)
    got = _logits(patched, ids, mask)
    assert len(calls) == 2 and not any(c["dense"] for c in calls)
    assert_close(got[mask.bool()], expected[mask.bool()], what="CPU copy")


def test_conflicting_keywords_are_errors_or_warnings(cpu_llama):
    with pytest.raises(ValueError, match="not both"):
        apply_splash_attention(cpu_llama, SplashAttentionConfig(), sa_block_q=4)
    with pytest.raises(ValueError, match="disagree"):
        apply_splash_attention(cpu_llama, SplashAttentionConfig(layers=[0]), layer_indices=[1])
    with pytest.raises(TypeError, match="transformers model"):
        apply_splash_attention(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown attention_config"):
        apply_splash_attention(cpu_llama, block=4)
    with pytest.warns(UserWarning, match="block_size=4 is ignored"):
        with pytest.warns(UserWarning, match="portable"):
            apply_splash_attention(cpu_llama, SplashAttentionConfig(sa_block_q=8), block_size=4)
    assert cpu_llama.model.layers[1].self_attn.autoxla_attention.config.sa_block_q == 8
    with pytest.warns(UserWarning, match="model_type='gemma2' is not used"):
        with pytest.warns(UserWarning, match="portable"):
            SplashAttentionPatcher({}, model_type="gemma2").patch_model(cpu_llama)
