"""SAM 3's text-prompted detector (transformers' Sam3Model, what facebook/sam3's Sam3Config builds)
through AutoXLAModelForImageSegmentation's AutoModel fallback, on 8 devices, against the same
checkpoint in plain transformers on the CPU (fp32), with text prompts and with text + box prompts."""
import copy
import importlib.util
import warnings

import pytest
import torch
from torch import nn

from AutoXLA import AutoXLAModelForImageSegmentation, backend
from AutoXLA.testing import tiny_vision
from AutoXLA.quantization import ModelQuantizer, QuantizationConfig, QuantizedLinear
from tests.helpers import assert_close, check_sharding_matches_plan

pytestmark = pytest.mark.skipif(not hasattr(__import__("transformers"), "Sam3Model"),
                                reason="this transformers has no Sam3Model")

# Outputs are mask logits (|x| <= ~12), boxes in [0, 1], query and presence logits (|x| <= ~1) and a
# semantic map (|x| <= ~2), through a ViT, an FPN, a CLIP text tower and DETR layers of fan-in
# <= 2,000 (the 14x14 patch convolution), in fp32 on both sides. Sharding only reorders those sums
# (a few ulps each), and the loader's eager attention differs from the reference's sdpa by as
# much: observed <= 1.6e-5 on the masks (1.5e-6 relative), <= 3e-6 on the rest, fsdp and 2d alike.
# 1e-4 absolute + 1e-4 relative covers that with room, while a misplaced shard (a wrong half of a
# head, a scale on the wrong rows) moves outputs by O(0.1-1).
ATOL, RTOL = 1e-4, 1e-4
# int8 (per channel, every linear) against the float model: a quantization error, not a sharding
# one. The floor of the other segmentation families (25 dB: 0.3% relative noise power). Measured
# on this fixture: 30.5-46.5 dB with the text prompt, 26.9-46.5 dB with boxes (the lowest is
# pred_logits, a dot product of two quantized projections, so the errors of both add). A broken
# quantized layer gives < 5 dB.
INT8_SQNR_DB = 25.0
PROMPTS = [
    "text",
    pytest.param("text+boxes", marks=pytest.mark.skipif(
        importlib.util.find_spec("torchvision") is None,
        reason="Sam3Model's box prompts pool image features with torchvision.ops.roi_align, and "
               "torchvision is not installed (pip install torchvision pillow)")),
]


def _inputs(prompt):
    return tiny_vision.sam3_detector_inputs(boxes=prompt == "text+boxes")


def _run(model, prompt, device=None):
    inputs = _inputs(prompt)
    if device is not None:
        inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.no_grad():
        outputs = tiny_vision.sam3_detector_outputs(model(**inputs))
    if device is not None:
        # One graph for all five outputs: moving them one by one would compile and run a graph
        # per output (each holding most of the model), five times the compile time.
        backend.sync()
    return {k: v.cpu() for k, v in outputs.items()}


def _sqnr_db(got, ref):
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


@pytest.fixture(scope="module")
def reference(sam3_detector_checkpoint):
    """The checkpoint in plain transformers on the CPU (fp32, its default attention)."""
    from transformers import Sam3Model

    return Sam3Model.from_pretrained(sam3_detector_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loaded(sam3_detector_checkpoint, xla_devices):
    """strategy -> the checkpoint loaded by AutoXLA (each strategy loaded once for the module)."""
    cache = {}

    def load(strategy):
        if strategy not in cache:
            cache[strategy] = AutoXLAModelForImageSegmentation.from_pretrained(
                sam3_detector_checkpoint, sharding_strategy=strategy)
        return cache[strategy]

    return load


def test_sam3_config_resolves_to_sam3model_through_automodel():
    from transformers import Sam3Model

    from AutoXLA.modeling.pipeline import pick_auto_class
    from AutoXLA.modeling.segmentation import auto_classes

    auto = pick_auto_class(auto_classes(), tiny_vision.sam3_detector_config())
    assert auto.__name__ == "AutoModel"
    assert [c.__name__ for c in auto_classes()][-2:] == ["AutoModelForImageSegmentation",
                                                         "AutoModel"]
    assert type(tiny_vision.sam3_detector_model()) is Sam3Model


def test_the_automodel_fallback_leaves_out_text_models():
    # AutoModel maps LlamaConfig (to LlamaModel) and Mistral3Config too: the segmentation loader
    # refuses them and names the loader that takes them.
    import transformers

    from AutoXLA.modeling.pipeline import pick_auto_class
    from AutoXLA.modeling.segmentation import auto_classes

    for config in (transformers.LlamaConfig(), transformers.Mistral3Config()):
        assert type(config) in transformers.AutoModel._model_mapping
        with pytest.raises(ValueError, match=rf"{type(config).__name__} .* AutoModel can build.*"
                                             r"AutoXLAModelForCausalLM loads those"):
            pick_auto_class(auto_classes(), config)


def test_inputs_change_the_outputs(reference):
    # The fixture is informative: the text prompt and the boxes each move every output family,
    # so an input dropped or misrouted on the devices would show.
    text = _run(reference, "text")
    other = tiny_vision.sam3_detector_inputs(seed=1)
    other["pixel_values"] = _inputs("text")["pixel_values"]
    with torch.no_grad():
        changed = tiny_vision.sam3_detector_outputs(reference(**other))
    for name in ("pred_masks", "pred_logits", "presence_logits"):
        assert (text[name] - changed[name]).abs().max() > 1e-2, f"the text prompt does not reach {name}"
    assert text["pred_masks"].shape == (2, 6, 32, 32) and text["pred_boxes"].shape == (2, 6, 4)
    assert text["semantic_seg"].shape == (2, 1, 32, 32) and text["presence_logits"].shape == (2, 1)
    if importlib.util.find_spec("torchvision") is not None:
        boxed = _run(reference, "text+boxes")
        assert (text["pred_logits"] - boxed["pred_logits"]).abs().max() > 1e-2


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("strategy", ["fsdp", "2d"])
def test_outputs_equal_transformers(strategy, prompt, loaded, reference):
    model = loaded(strategy)
    assert type(model).__name__ == "Sam3Model"
    got, expected = _run(model, prompt, backend.device()), _run(reference, prompt)
    for name in tiny_vision.SAM3_DETECTOR_OUTPUTS:
        assert_close(got[name], expected[name], ATOL, RTOL, what=f"{strategy}/{prompt} {name}")
    assert check_sharding_matches_plan(model, model.autoxla_plan, model.autoxla_mesh) > 0


def test_plan_gives_every_part_vision_roles(loaded):
    model = loaded("2d")
    plan = {t.name: t for t in model.autoxla_plan}
    expected = {
        # ViT backbone and FPN neck
        "vision_encoder.backbone.layers.0.attention.q_proj.weight": "column_linear",
        "vision_encoder.backbone.layers.0.attention.o_proj.weight": "row_linear",
        "vision_encoder.backbone.layers.1.mlp.fc1.weight": "column_linear",
        "vision_encoder.backbone.layers.1.mlp.fc2.weight": "row_linear",
        "vision_encoder.backbone.embeddings.patch_embeddings.projection.weight": "conv",
        "vision_encoder.neck.fpn_layers.0.scale_layers.0.weight": "conv",
        "vision_encoder.neck.fpn_layers.2.proj2.weight": "conv",
        # CLIP text tower
        "text_encoder.text_model.embeddings.token_embedding.weight": "vocab_embedding",
        "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.weight": "column_linear",
        "text_encoder.text_model.encoder.layers.0.self_attn.out_proj.weight": "row_linear",
        "text_encoder.text_model.encoder.layers.1.mlp.fc1.weight": "column_linear",
        # geometry (box) encoder
        "geometry_encoder.layers.0.cross_attn.k_proj.weight": "column_linear",
        "geometry_encoder.layers.0.cross_attn.o_proj.weight": "row_linear",
        "geometry_encoder.boxes_pool_project.weight": "conv",
        # DETR encoder and decoder, with the decoder's MLP heads as column/row pairs
        "detr_encoder.layers.0.self_attn.v_proj.weight": "column_linear",
        "detr_encoder.layers.0.mlp.fc2.weight": "row_linear",
        "detr_decoder.layers.1.text_cross_attn.q_proj.weight": "column_linear",
        "detr_decoder.layers.1.vision_cross_attn.o_proj.weight": "row_linear",
        "detr_decoder.box_head.layer1.weight": "column_linear",
        "detr_decoder.box_head.layer2.weight": "row_linear",
        "dot_product_scoring.text_mlp.layer1.weight": "column_linear",
        "dot_product_scoring.text_mlp.layer2.weight": "row_linear",
        # mask decoder
        "mask_decoder.prompt_cross_attn.q_proj.weight": "column_linear",
        "mask_decoder.pixel_decoder.conv_layers.0.weight": "conv",
    }
    assert {n: plan[n].role for n in expected} == expected
    # 2d is fsdp=4 x model=2: these split on both axes.
    assert plan["detr_decoder.layers.0.self_attn.q_proj.weight"].spec == ("model", "fsdp")
    assert plan["vision_encoder.backbone.layers.0.mlp.fc2.weight"].spec == ("fsdp", "model")
    # Every linear has a linear role, and what is replicated is replicated for divisibility only
    # (tables and heads of 1 to 20 rows: 6 queries, 2 box labels, 4 box coordinates, ...).
    linears = {f"{n}.weight": plan[f"{n}.weight"].role for n, m in model.named_modules()
               if isinstance(m, nn.Linear)}
    assert linears and set(linears.values()) == {"column_linear", "row_linear", "linear"}
    whole = [t for t in plan.values()
             if not t.is_buffer and t.shard_shape == t.shape and len(t.shape) > 0]
    assert whole and all("does not divide" in t.reason for t in whole), \
        {t.name: t.reason for t in whole if "does not divide" not in t.reason}


@pytest.fixture(scope="module")
def int8_models(sam3_detector_checkpoint, reference, xla_devices):
    """The seed's example on the local checkpoint, and the same int8 quantization of the
    reference without sharding (plain transformers + ModelQuantizer on the CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # use_pallas off a TPU
        # The seed's example, with its "facebook/sam3" replaced by the local tiny Sam3Model.
        model = AutoXLAModelForImageSegmentation.from_pretrained(
            sam3_detector_checkpoint,
            sharding_strategy="fsdp",
            do_quant=True,
            quantization_config=QuantizationConfig(n_bits=8, use_pallas=True),
        )
        unsharded = copy.deepcopy(reference)
        ModelQuantizer(QuantizationConfig(n_bits=8)).quantize_model(unsharded)
    return model, unsharded


@pytest.mark.parametrize("prompt", PROMPTS)
def test_int8_seed_example(prompt, int8_models, reference):
    model, unsharded = int8_models
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    for part in ("vision_encoder.", "text_encoder.", "geometry_encoder.", "detr_encoder.",
                 "detr_decoder.", "mask_decoder.", "dot_product_scoring."):
        assert any(n.startswith(part) for n in quantized), f"nothing in {part} was quantized"
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear]
    got = _run(model, prompt, backend.device())
    expected_q, expected = _run(unsharded, prompt), _run(reference, prompt)
    for name in tiny_vision.SAM3_DETECTOR_OUTPUTS:
        # Sharded int8 equals unsharded int8 as closely as float equals float (same bound).
        assert_close(got[name], expected_q[name], ATOL, RTOL, what=f"int8/{prompt} {name}")
        sqnr = _sqnr_db(got[name], expected[name])
        assert sqnr >= INT8_SQNR_DB, f"{prompt} {name}: SQNR {sqnr:.1f} dB < {INT8_SQNR_DB} dB"
