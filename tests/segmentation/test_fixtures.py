"""The tiny segmentation checkpoints of AutoXLA.testing.tiny_vision, in plain transformers on the CPU.

No XLA here: these pin the fixtures themselves (sharded files, which auto class loads them, that
their outputs are finite, informative and fast) so that the sharded tests built on them can trust
them.
"""
import json
import time

import pytest
import torch

from AutoXLA.testing import tiny_vision

FAMILIES = tiny_vision.available_families()
MISSING = tiny_vision.missing_families()
# Every family is a test case; one this environment cannot build shows as skipped, with the reason.
ALL = [pytest.param(f, marks=pytest.mark.skip(reason=MISSING[f])) if f in MISSING else f
       for f in tiny_vision.FAMILIES]

# The auto class each family must resolve to (the first of the seed's order that maps its config).
EXPECTED_AUTO = {
    "sam": "AutoModelForMaskGeneration",
    "sam2": "AutoModelForMaskGeneration",
    "sam3": "AutoModelForMaskGeneration",
    "mask2former": "AutoModelForUniversalSegmentation",
    "segformer": "AutoModelForSemanticSegmentation",
    "upernet": "AutoModelForSemanticSegmentation",
}

# Output shapes for tiny_inputs(family, batch=2).
EXPECTED_SHAPES = {
    # (batch, point_batch, multimask outputs, 4 x the 8x8 image embedding)
    "sam": {"pred_masks": (2, 2, 3, 32, 32), "iou_scores": (2, 2, 3)},
    "sam2": {"pred_masks": (2, 2, 3, 32, 32), "iou_scores": (2, 2, 3)},
    "sam3": {"pred_masks": (2, 2, 3, 32, 32), "iou_scores": (2, 2, 3)},
    # (batch, queries, labels + "no object") and (batch, queries, image / 4, image / 4)
    "mask2former": {"class_queries_logits": (2, 10, 6), "masks_queries_logits": (2, 10, 16, 16)},
    # SegFormer predicts at 1/4 of the input, UperNet upsamples back to it.
    "segformer": {"logits": (2, 5, 16, 16)},
    "upernet": {"logits": (2, 5, 64, 64)},
}

pytestmark = pytest.mark.skipif(not FAMILIES, reason="no segmentation family in this transformers")


def _first_auto_class(config):
    """The loader's own choice (AutoXLA.modeling.segmentation), pinned by EXPECTED_AUTO."""
    from AutoXLA.modeling.pipeline import pick_auto_class
    from AutoXLA.modeling.segmentation import auto_classes

    return pick_auto_class(auto_classes(), config)


@pytest.fixture(scope="module")
def loaded(seg_checkpoints):
    """family -> (auto class used, model loaded back from the checkpoint, eval mode)."""
    from transformers import AutoConfig

    out = {}
    for f, path in seg_checkpoints.items():
        auto = _first_auto_class(AutoConfig.from_pretrained(path))
        model = auto.from_pretrained(path) if auto is not None else None
        out[f] = (auto, model.eval() if model is not None else None)
    return out


def test_auto_class_order():
    import transformers

    from AutoXLA.modeling.segmentation import AUTO_CLASS_NAMES

    assert AUTO_CLASS_NAMES == (
        "AutoModelForMaskGeneration", "AutoModelForUniversalSegmentation",
        "AutoModelForInstanceSegmentation", "AutoModelForSemanticSegmentation")
    assert all(hasattr(transformers, n) for n in AUTO_CLASS_NAMES)


def test_every_family_accounted_for():
    assert set(FAMILIES) | set(MISSING) == set(tiny_vision.FAMILIES)
    assert not set(FAMILIES) & set(MISSING)


@pytest.mark.parametrize("family", ALL)
def test_sharded_checkpoint(seg_checkpoints, family):
    path = seg_checkpoints[family]
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) >= 2, shards
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert (path / "config.json").is_file()


@pytest.mark.parametrize("family", ALL)
def test_auto_class_resolution(seg_checkpoints, loaded, family):
    auto, model = loaded[family]
    assert auto is not None and auto.__name__ == EXPECTED_AUTO[family]
    assert type(model) is tiny_vision.model_class(family)
    # Every weight and buffer made the round trip (keys renamed on save are mapped back).
    seed = FAMILIES.index(family)
    reference = tiny_vision.tiny_model(family, seed=seed).state_dict()
    state = model.state_dict()
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name


def test_inputs_deterministic():
    for family in FAMILIES:
        a, b = tiny_vision.tiny_inputs(family, seed=3), tiny_vision.tiny_inputs(family, seed=3)
        c = tiny_vision.tiny_inputs(family, seed=4)
        assert a.keys() == b.keys() == c.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert not torch.equal(a["pixel_values"], c["pixel_values"])


@pytest.mark.parametrize("family", ALL)
def test_forward(loaded, family):
    _, model = loaded[family]
    inputs = tiny_vision.tiny_inputs(family, batch=2)
    size = tiny_vision.image_size(family)
    assert inputs["pixel_values"].shape == (2, 3, size, size)
    with torch.no_grad():
        outputs = tiny_vision.comparable_outputs(family, model(**inputs))
        # Best of three: the machine may be busy; a model that is really slow stays slow.
        elapsed = []
        for _ in range(3):
            start = time.perf_counter()
            model(**inputs)
            elapsed.append(time.perf_counter() - start)
    assert min(elapsed) < 2.0, elapsed
    assert {k: tuple(v.shape) for k, v in outputs.items()} == EXPECTED_SHAPES[family]
    for name, value in outputs.items():
        assert torch.isfinite(value).all(), name
        assert value.float().std() > 1e-3, (name, value.float().std())
        assert (value[0] - value[1]).abs().max() > 1e-3, name


def test_checkpoint_keys_follow_transformers_renames(seg_checkpoints):
    # SegFormer is saved in its hub layout (decode_head.linear_c.N.proj ...): every model name
    # maps to a saved key through transformers' own renaming rules, and nothing needs converting.
    from safetensors import safe_open

    from AutoXLA.loading.checkpoint import renamed_keys

    path = seg_checkpoints["segformer"]
    saved = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            saved |= set(h.keys())
    model = tiny_vision.model_class("segformer")(tiny_vision.tiny_config("segformer"))
    names, converted = renamed_keys(model, saved)
    assert not converted and set(names.values()) == saved
    assert set(model.state_dict()) - set(names) <= {k for k in model.state_dict()
                                                   if k.endswith("num_batches_tracked")}
    assert any(k != v for k, v in names.items()), "segformer no longer renames: pick another"


def test_keys_that_need_a_tensor_conversion_are_reported(monkeypatch):
    from transformers import conversion_mapping
    from transformers.core_model_loading import Concatenate, WeightConverter

    from AutoXLA.loading.checkpoint import renamed_keys

    model = tiny_vision.model_class("segformer")(tiny_vision.tiny_config("segformer"))
    fuse = WeightConverter(["a.weight", "b.weight"], "ab.weight", operations=[Concatenate(dim=0)])
    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", lambda m: [fuse])
    names, converted = renamed_keys(model, {"a.weight", "b.weight", "c.weight"})
    assert converted == ["a.weight", "b.weight"] and names["c.weight"] == "c.weight"
