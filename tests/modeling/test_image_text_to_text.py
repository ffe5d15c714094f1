"""Image-text-to-text checkpoints (Mistral 3, LLaVA) through AutoXLAModelForCausalLM, on 8 devices.

The reference is plain transformers (AutoModelForImageTextToText) on the CPU in fp32 with eager
attention, given the same input_ids (image tokens included) and pixel_values: its vision tower,
projector, feature merge and language model share nothing with AutoXLA's sharded run.
"""
import copy
import warnings

import pytest
import torch
from transformers import cache_utils
from transformers.cache_utils import DynamicSlidingWindowLayer

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.quantization import ModelQuantizer, QuantizationConfig
from AutoXLA.testing.tiny import (IMAGE_TEXT_FAMILIES, image_tokens_per_image,
                          save_tiny_image_text_checkpoint, tiny_image_text_config)

from ..helpers import assert_close, check_sharding_matches_plan

# Logits tolerance: helpers.py's reasoning (fp32 sums reordered by the shards, each a few ulps)
# holds here with 4 more layers (the vision tower's 2, the projector's) and reductions of up to
# 192 terms (the 8x8x3 patch convolution); observed max |diff| ~1e-5 on logits of magnitude ~6,
# while a misplaced image feature or a wrong shard moves them by O(1).
ATOL, RTOL = 1e-4, 1e-4
INT8_SQNR_FLOOR_DB = 25.0
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
VISION_Q = "model.vision_tower.transformer.layers.0.attention.q_proj.weight"


@pytest.fixture(scope="module")
def image_text_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("image_text")
    return {f: save_tiny_image_text_checkpoint(f, root / f, seed=i)
            for i, f in enumerate(IMAGE_TEXT_FAMILIES)}


@pytest.fixture(scope="module")
def references(image_text_checkpoints):
    from transformers import AutoModelForImageTextToText

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = AutoModelForImageTextToText.from_pretrained(
                image_text_checkpoints[family], dtype=torch.float32,
                attn_implementation="eager").eval()
        return cache[family]

    return get


def image_batch(family):
    """Two rows, each with one image's tokens; the second row left-padded. Two different images."""
    config = tiny_image_text_config(family)
    n = image_tokens_per_image(config)
    img = config.image_token_index
    ids = torch.tensor([[1, 5] + [img] * n + [6, 7, 8, 9],
                        [0, 0, 1] + [img] * n + [30, 31, 32]])
    size = config.vision_config.image_size
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(3))
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(), pixel_values=pixels)
    if family.startswith("mistral3"):        # Pixtral takes each image's size
        inputs["image_sizes"] = torch.tensor([[size, size]] * 2)
    if family == "gemma3":                   # its image tokens attend to each other both ways
        inputs["token_type_ids"] = (ids == img).long()
    return inputs


def _load(checkpoints, family, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # use_pallas off a TPU, said in the report
        return AutoXLAModelForCausalLM.from_pretrained(checkpoints[family], **kwargs)


def _logits(model, inputs):
    dev = backend.device()
    with torch.no_grad():
        return model(**{k: v.to(dev) for k, v in inputs.items()}).logits.cpu()


@pytest.fixture(scope="module")
def mistral3_2d_splash(image_text_checkpoints, xla_devices):
    """2d, with the splash kernel asked for: it must reach the language model only."""
    return _load(image_text_checkpoints, "mistral3", sharding_strategy="2d",
                 attn_implementation="splash_attention",
                 attention_config={"sa_block_q": 4, "sa_block_kv": 4})


def test_plan_shards_the_vision_tower_by_its_own_heads(image_text_checkpoints, capsys):
    from AutoXLA.cli import main
    from AutoXLA.modeling.from_config import plan_from_config

    plan = plan_from_config(image_text_checkpoints["mistral3"], "mp")    # model axis 8
    assert plan.model_class == "Mistral3ForConditionalGeneration"
    # Heads from the sub-config that owns each module (the top config has none): Pixtral's 4
    # heads and the text model's 2 kv heads do not divide model=8, its 8 query heads do.
    assert plan[VISION_Q].reason == "replicated on model: 4 heads do not divide model=8"
    k = plan["model.language_model.layers.0.self_attn.k_proj.weight"]
    assert k.reason == "replicated on model: 2 heads do not divide model=8"
    assert plan["model.language_model.layers.0.self_attn.q_proj.weight"].spec == ("model", None)
    roles = {name: (plan[name].role, plan[name].spec) for name in (
        "model.vision_tower.patch_conv.weight",
        "model.vision_tower.transformer.layers.0.feed_forward.gate_proj.weight",
        "model.vision_tower.transformer.layers.0.feed_forward.down_proj.weight",
        "model.multi_modal_projector.linear_1.weight",
        "model.multi_modal_projector.linear_2.weight")}
    assert roles == {
        "model.vision_tower.patch_conv.weight": ("conv", (None, None, None, None)),
        "model.vision_tower.transformer.layers.0.feed_forward.gate_proj.weight":
            ("column_linear", ("model", None)),
        "model.vision_tower.transformer.layers.0.feed_forward.down_proj.weight":
            ("row_linear", (None, "model")),
        "model.multi_modal_projector.linear_1.weight": ("column_linear", ("model", None)),
        "model.multi_modal_projector.linear_2.weight": ("row_linear", (None, "model"))}
    # The KV cache and the scanned stack are the language model's (text_config: 2 layers, 2 kv
    # heads of 8), not the vision tower's.
    assert plan.attention == (2, 2, 8)
    assert plan.stack.path == "model.language_model.layers" and plan.stack.scanned
    # The command line shows the same plan.
    assert main(["plan", str(image_text_checkpoints["mistral3"]), "--strategy", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "model.vision_tower.patch_conv.weight" in out and "multi_modal_projector.linear_1" in out


@pytest.mark.parametrize("case", ["fsdp", "2d_splash", "int8"])
def test_mistral3_with_an_image_equals_transformers(case, image_text_checkpoints, references,
                                                    mistral3_2d_splash, xla_devices):
    inputs = image_batch("mistral3")
    reference = references("mistral3")
    if case == "2d_splash":
        model = mistral3_2d_splash
    elif case == "fsdp":
        model = _load(image_text_checkpoints, "mistral3", sharding_strategy="fsdp")
    else:
        cfg = QuantizationConfig(bits=8)
        model = _load(image_text_checkpoints, "mistral3", sharding_strategy="fsdp", do_quant=True,
                      quantization_config=cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # The same C engine quantizes a CPU copy: only the sharding differs.
            reference = ModelQuantizer(cfg).quantize_model(copy.deepcopy(reference))
        assert model.autoxla_plan[VISION_Q].quant.startswith("int8")
    got = _logits(model, inputs)
    assert model.model.language_model.layers.last_mode == "scanned"   # the decoder stack's loop
    with torch.no_grad():
        expected = reference(**inputs).logits
        text_only = reference(input_ids=inputs["input_ids"],
                              attention_mask=inputs["attention_mask"]).logits
    valid = inputs["attention_mask"].bool()
    assert_close(got[valid], expected[valid], ATOL, RTOL, what=f"mistral3/{case} logits")
    # The image changed them: its features were merged into the text.
    assert (expected[valid] - text_only[valid]).abs().max() > 0.1
    if case == "int8":
        # And int8 stays close to the float model: the int8 floor of the causal tests
        # (tests/quantization/test_quantized_loading.py); measured 30.0 dB here.
        with torch.no_grad():
            floating = references("mistral3")(**inputs).logits[valid].double()
        error = (got[valid].double() - floating).norm()
        assert 20 * torch.log10(floating.norm() / error) >= INT8_SQNR_FLOOR_DB
    plan = model.autoxla_plan
    q = plan[VISION_Q]
    assert q.role == "column_linear" and q.spec == ({"fsdp": (None, "fsdp"), "int8": (None, "fsdp"),
                                                     "2d_splash": ("model", "fsdp")}[case])
    assert check_sharding_matches_plan(model, plan, model.autoxla_mesh) == len(
        [t for t in plan if not t.is_buffer or t.quant])


def test_static_masked_scatter_equals_torch():
    from AutoXLA.modeling.image_text import static_masked_scatter

    g = torch.Generator().manual_seed(0)
    target = torch.randn(3, 7, 5, generator=g)
    for mask in (torch.rand(3, 7, 1, generator=g) < 0.4,       # whole rows, as image tokens
                 torch.rand(3, 7, 5, generator=g) < 0.5):      # any elements
        source = torch.randn(int(torch.broadcast_to(mask, target.shape).sum()) + 4, generator=g)
        assert torch.equal(static_masked_scatter(target, mask, source),
                           target.masked_scatter(mask, source))


def test_image_tokens_that_do_not_match_the_image_are_an_error(mistral3_2d_splash):
    inputs = image_batch("mistral3")
    inputs["input_ids"] = inputs["input_ids"].masked_fill(inputs["input_ids"] == 10, 5)
    inputs["input_ids"][:, 3] = 10                   # one image token per row, 4 features each
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        _logits(mistral3_2d_splash, inputs)
    # The forward raised: transformers' table of cache layers is its own again all the same
    # (AutoXLA gives it clamped sliding layers only while its models run: dynamic_cache.py).
    assert cache_utils.DYNAMIC_LAYER_TYPE_MAPPING["sliding_attention"] is DynamicSlidingWindowLayer


def test_kernel_patches_the_language_model_only(mistral3_2d_splash):
    hf = mistral3_2d_splash
    assert hf.config.text_config._attn_implementation == "autoxla_splash"
    assert hf.config.vision_config._attn_implementation == "eager"
    text = [m for m in hf.model.language_model.modules() if type(m).__name__.endswith("Attention")]
    vision = [m for m in hf.model.vision_tower.modules() if type(m).__name__.endswith("Attention")]
    assert len(text) == 2 and all(m.autoxla_attention is not None for m in text)
    assert len(vision) == 2 and not any(hasattr(m, "autoxla_attention") for m in vision)


def test_text_generation_equals_transformers(mistral3_2d_splash, references):
    ids = torch.tensor([[5, 6, 7, 8, 9, 11, 12], [0, 0, 40, 41, 42, 43, 44]])
    mask = (ids != 0).long()
    dev = backend.device()
    counts = []
    for n in (8, 32):
        before = backend.compile_count()
        got = mistral3_2d_splash.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                          max_new_tokens=n, **GREEDY).cpu()
        counts.append(backend.compile_count() - before)
    # One prefill and one decode program for the (batch, prompt, cache) buckets; 32 tokens fit
    # the same cache bucket as 8: nothing new, whatever the number of tokens.
    assert counts == [2, 0], counts
    expected = references("mistral3").generate(input_ids=ids, attention_mask=mask,
                                               max_new_tokens=32, **GREEDY)
    assert torch.equal(got, expected), (
        f"first difference at {(got != expected).nonzero()[:1].tolist()}")
    with pytest.raises(ValueError, match="text-only"):
        mistral3_2d_splash.generate(input_ids=ids.to(dev), pixel_values=torch.zeros(2, 3, 32, 32),
                                    max_new_tokens=4, **GREEDY)


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_mistral3_with_mistrals_own_4096_window(scan, image_text_checkpoints, references, batch,
                                                xla_devices):
    # Issue 43: Mistral3Config with a `mistral` text config keeps MistralConfig's 4096-token
    # window. A plain forward raised "Value out of range ... got -4095": the dynamic cache's
    # sliding layers slice full[:, :, -4095:] of 12 positions, which torch_xla refuses. The fix of
    # the causal-LM path read the window off the top config, which an image-text config lacks
    # (it is in text_config), and the language model built its own cache unfixed.
    family = "mistral3_mistral"
    model = _load(image_text_checkpoints, family, sharding_strategy="fsdp", scan_layers=scan)
    reference = references(family)
    assert model.config.text_config.sliding_window == 4096
    ids, mask = batch                                       # 12 text tokens, one row left-padded
    valid = mask.bool()
    got = _logits(model, dict(input_ids=ids, attention_mask=mask))
    layers = model.model.language_model.layers
    assert (layers.last_mode == "scanned") if scan else isinstance(layers, torch.nn.ModuleList)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
    assert_close(got[valid], expected[valid], ATOL, RTOL, what=f"{family} text logits")
    assert cache_utils.DYNAMIC_LAYER_TYPE_MAPPING["sliding_attention"] is DynamicSlidingWindowLayer
    inputs = image_batch(family)
    valid = inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**inputs).logits
    assert_close(_logits(model, inputs)[valid], expected[valid], ATOL, RTOL,
                 what=f"{family} image logits")
    if scan:    # generation (AutoXLA's static cache, full-length layers for the window)
        dev = backend.device()
        got = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                             max_new_tokens=8, **GREEDY).cpu()
        expected = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                      **GREEDY)
        assert torch.equal(got, expected), (got.tolist(), expected.tolist())


def test_gemma3_with_its_own_4096_window(image_text_checkpoints, references, batch, xla_devices):
    # The same failure in another image-text model with sliding layers (Gemma3TextConfig's 4096):
    # the fix is where any DynamicCache gets its layers, not per model class.
    model = _load(image_text_checkpoints, "gemma3", sharding_strategy="fsdp")
    reference = references("gemma3")
    ids, mask = batch
    valid = mask.bool()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
    got = _logits(model, dict(input_ids=ids, attention_mask=mask))
    assert_close(got[valid], expected[valid], ATOL, RTOL, what="gemma3 text logits")
    inputs = image_batch("gemma3")
    valid = inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**inputs).logits
        text_only = reference(input_ids=inputs["input_ids"],
                              attention_mask=inputs["attention_mask"]).logits
    assert_close(_logits(model, inputs)[valid], expected[valid], ATOL, RTOL,
                 what="gemma3 image logits")
    assert (expected[valid] - text_only[valid]).abs().max() > 0.1     # the image mattered


def test_llava_loads_and_equals_transformers(image_text_checkpoints, references, xla_devices):
    inputs = image_batch("llava")
    model = _load(image_text_checkpoints, "llava", sharding_strategy="fsdp")
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    got = _logits(model, inputs)
    with torch.no_grad():
        expected = references("llava")(**inputs).logits
    valid = inputs["attention_mask"].bool()
    assert_close(got[valid], expected[valid], ATOL, RTOL, what="llava/fsdp logits")
    plan = model.autoxla_plan
    assert plan["model.vision_tower.encoder.layers.0.mlp.fc1.weight"].role == "column_linear"
    assert plan.stack.path == "model.language_model.layers"


def test_a_config_neither_class_builds_is_one_error(tmp_path):
    from transformers import SegformerConfig

    SegformerConfig().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="neither a causal LM .* nor an image-text-to-text"):
        AutoXLAModelForCausalLM.from_pretrained(tmp_path)
