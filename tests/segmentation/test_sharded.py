"""Segmentation models on 8 devices: from_pretrained, from_model, quantization, the seed's examples,
each against the same checkpoint in plain transformers on the CPU (fp32)."""
import warnings

import pytest
import torch
from torch import nn

from AutoXLA import AutoXLAModelForImageSegmentation, AutoXLAModelForMaskGeneration, backend
from AutoXLA.testing import tiny_vision
from AutoXLA.quantization import QuantizationConfig, QuantizedLinear
from tests.helpers import assert_close, check_sharding_matches_plan

FAMILIES = tiny_vision.available_families()
# Outputs are masks/logits of magnitude <= ~6 from convolutions, attention and MLPs of fan-in
# <= ~1700, computed in fp32 on both sides: sharding reorders those sums (a few ulps each), so
# differences are ~1e-6 to 1e-5 (observed <= 1e-5). 1e-4 absolute + 1e-4 relative covers that,
# while a misplaced shard changes outputs by O(0.1-1).
ATOL, RTOL = 1e-4, 1e-4
INT8_SQNR_DB = 25.0
# Mask2Former misses 25 dB (measured 21.9 dB class logits, 19.4 dB mask logits, all linears int8
# per channel, also on the CPU without sharding, so not a sharding effect). Its masked-attention
# decoder thresholds each layer's predicted masks at 0.5 to mask the next layer's attention, so a
# small error that flips a mask entry becomes a large one; random weights leave many mask logits
# near the threshold. Quantizing only its most sensitive linear (a Swin patch-merging reduction)
# already gives 26.3 dB. Issue 14's machinery, measured on the CPU (class / mask logits, dB):
# scale_search 23.5 / 20.1; float16 scales 27.5 / 21.5; blocks of 32 22.0-27.9 / 22.0, searched
# 25.2 / 23.5; keeping the 8 most sensitive linears in float 28.7 / 22.5; int8 blocks of 8
# searched (10 bits per weight) 28.8 / 28.1. The error is not monotonic in the weight error
# (mask flips), so no setting at int8's 8-8.5 bits is reliably above 25 dB. The floor below catches a broken quantized layer (which gives < 5 dB,
# e.g. 0.6 dB when nn.MultiheadAttention read an int8 weight as floats); the exact check that the
# sharded quantized model equals the unsharded one is what shows the machinery is right.
INT8_SQNR_FLOOR_DB = {"mask2former": 18.0}


@pytest.fixture(scope="module")
def references(seg_checkpoints):
    """family -> the checkpoint in plain transformers (CPU, fp32) and its outputs on tiny_inputs."""
    out = {}
    for f, path in seg_checkpoints.items():
        model = tiny_vision.model_class(f).from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out[f] = (model, tiny_vision.comparable_outputs(f, model(**tiny_vision.tiny_inputs(f))))
    return out


def _outputs(model, family):
    dev = backend.device()
    inputs = {k: v.to(dev) for k, v in tiny_vision.tiny_inputs(family).items()}
    with torch.no_grad():
        return {k: v.cpu() for k, v in tiny_vision.comparable_outputs(family, model(**inputs)).items()}


def _sqnr_db(got, ref):
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


# fsdp and 2d: 2d splits the model axis as mp does (2 ways instead of 8), so mp adds compile
# time, not a code path.
@pytest.mark.parametrize("strategy", ["fsdp", "2d"])
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_equal_transformers(family, strategy, seg_checkpoints, references, xla_devices):
    model = AutoXLAModelForImageSegmentation.from_pretrained(seg_checkpoints[family],
                                                             sharding_strategy=strategy)
    plan = model.autoxla_plan
    assert plan.model_class == tiny_vision.model_class(family).__name__
    got = _outputs(model, family)
    for name, expected in references[family][1].items():
        assert_close(got[name], expected, ATOL, RTOL, what=f"{family}/{strategy} {name}")
    assert check_sharding_matches_plan(model, plan, model.autoxla_mesh) > 0


def test_relative_position_tables_are_replicated_with_a_reason(seg_checkpoints, xla_devices):
    model = AutoXLAModelForImageSegmentation.from_pretrained(seg_checkpoints["sam"],
                                                             sharding_strategy="fsdp")
    rel = [t for t in model.autoxla_plan if t.name.endswith(("rel_pos_h", "rel_pos_w"))]
    assert rel and all(t.shard_shape == t.shape for t in rel)
    assert all("does not divide" in t.reason for t in rel), [t.reason for t in rel]
    roles = {t.name: t.role for t in model.autoxla_plan}
    assert roles["vision_encoder.layers.0.attn.qkv.weight"] == "column_linear"
    assert roles["vision_encoder.layers.0.attn.proj.weight"] == "row_linear"
    assert roles["vision_encoder.patch_embed.projection.weight"] == "conv"


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_quantized(family, seg_checkpoints, references, xla_devices):
    excluded = "iou_prediction_head" if family.startswith("sam") else "class_predictor"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # use_pallas off a TPU; patterns some families lack
        model = AutoXLAModelForImageSegmentation.from_pretrained(
            seg_checkpoints[family], sharding_strategy="2d", do_quant=True,
            quantization_config=QuantizationConfig(n_bits=8, use_pallas=True,
                                                   exclude_layers=[excluded]))
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized, "nothing was quantized"
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            assert excluded not in name, f"{name} should have been kept in full precision"
            assert m.bias is None or m.bias.dtype == torch.float32      # biases stay float
        elif excluded in name.split(".") and isinstance(m, nn.Linear):
            assert type(m) is nn.Linear
    got = _outputs(model, family)
    # The same quantization without sharding: plain transformers + ModelQuantizer on the CPU.
    import copy

    from AutoXLA.quantization import ModelQuantizer

    unsharded = copy.deepcopy(references[family][0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ModelQuantizer(QuantizationConfig(n_bits=8, exclude_layers=[excluded])).quantize_model(
            unsharded)
    with torch.no_grad():
        expected_q = tiny_vision.comparable_outputs(family, unsharded(**tiny_vision.tiny_inputs(family)))
    floor = INT8_SQNR_FLOOR_DB.get(family, INT8_SQNR_DB)
    for name, expected in references[family][1].items():
        assert_close(got[name], expected_q[name], ATOL, RTOL, what=f"{family} int8 {name}")
        sqnr = _sqnr_db(got[name], expected)
        assert sqnr >= floor, f"{family} {name}: SQNR {sqnr:.1f} dB < {floor} dB"


def test_from_model_equals_from_pretrained(seg_checkpoints, references, xla_devices):
    # A SAM built in code (not loaded from files), with the same weights as the checkpoint.
    from transformers import SamModel

    path = seg_checkpoints["sam"]
    built = SamModel(tiny_vision.tiny_config("sam"))
    built.load_state_dict(references["sam"][0].state_dict())
    a = AutoXLAModelForImageSegmentation.from_model(built, sharding_strategy="2d")
    b = AutoXLAModelForImageSegmentation.from_pretrained(path, sharding_strategy="2d")
    got_a, got_b = _outputs(a, "sam"), _outputs(b, "sam")
    # Not bit-equal: a model built in code keeps its default attention (sdpa), while
    # from_pretrained builds segmentation models with eager attention.
    for name, expected in references["sam"][1].items():
        assert_close(got_a[name], got_b[name], ATOL, RTOL, what=f"from_model vs from_pretrained {name}")
        assert_close(got_a[name], expected, ATOL, RTOL, what=f"from_model {name}")
    assert [t.spec for t in a.autoxla_plan] == [t.spec for t in b.autoxla_plan]


def test_from_model_on_a_plain_module(xla_devices):
    # Not a transformers model at all: no config, a shared (tied) parameter, a buffer.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
            self.head_a, self.head_b = nn.Linear(8, 4), nn.Linear(8, 4, bias=False)
            self.head_b.weight = self.head_a.weight          # one tensor under two names
            self.register_buffer("scale", torch.tensor(0.5))

        def forward(self, x):
            h = self.fc2(torch.relu(self.fc1(self.conv(x).mean((2, 3)))))
            return (self.head_a(h) + self.head_b(h)) * self.scale

    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(8, 3, 8, 8)
    with torch.no_grad():
        expected = net(x)
    model = AutoXLAModelForImageSegmentation.from_model(net, sharding_strategy="fsdp", do_quant=True)
    assert isinstance(model.fc1, QuantizedLinear)
    with torch.no_grad():
        got = model(x.to(backend.device())).cpu()
    assert _sqnr_db(got, expected) >= INT8_SQNR_DB


def test_seed_examples(seg_checkpoints, references, xla_devices):
    path = str(seg_checkpoints["sam3"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # use_pallas off a TPU
        # --- from the seed ("facebook/sam3" -> a local tiny SAM 3 checkpoint) ---
        from AutoXLA import AutoXLAModelForImageSegmentation
        from AutoXLA.quantization import QuantizationConfig

        model = AutoXLAModelForImageSegmentation.from_pretrained(
            path,
            sharding_strategy="fsdp",
            do_quant=True,
            quantization_config=QuantizationConfig(n_bits=8, use_pallas=True),
        )
        # --- end of the seed's first example ---
    got = _outputs(model, "sam3")
    for name, expected in references["sam3"][1].items():
        assert _sqnr_db(got[name], expected) >= INT8_SQNR_DB, name

    def build_sam3_image_model(load_from_HF=True, eval_mode=False):
        # Stands in for sam3.model_builder.build_sam3_image_model: the PyPI package does not build
        # off a GPU (see docs/segmentation.md). A SAM built in code, not loaded from files.
        from transformers import SamModel

        built = SamModel(tiny_vision.tiny_config("sam"))
        built.load_state_dict(references["sam"][0].state_dict())
        return built.train(not eval_mode)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "output_upscaling" is named upscale_* in transformers
        # --- from the seed (the sam3 import replaced by the stand-in above) ---
        model = build_sam3_image_model(load_from_HF=True, eval_mode=False)

        model = AutoXLAModelForImageSegmentation.from_model(
            model,
            sharding_strategy="fsdp",
            do_quant=True,
            quantization_config=QuantizationConfig(
                n_bits=8,
                use_pallas=True,
                # keep accuracy-sensitive heads in full precision
                exclude_layers=["iou_prediction_head", "output_upscaling"],
            ),
        )
        # --- end of the seed's second example ---
    head = model.mask_decoder.iou_prediction_head
    assert all(type(m) is nn.Linear for m in head.modules() if isinstance(m, nn.Linear))
    got = _outputs(model, "sam")
    for name, expected in references["sam"][1].items():
        assert _sqnr_db(got[name], expected) >= INT8_SQNR_DB, name
    assert AutoXLAModelForMaskGeneration is AutoXLAModelForImageSegmentation


def test_kernel_attention_is_ignored_with_one_warning(seg_checkpoints, references, caplog,
                                                      xla_devices):
    from AutoXLA.attention.hf import _WARNED

    _WARNED.discard("vision-splash_attention")
    with caplog.at_level("WARNING", logger="AutoXLA"):
        for _ in range(2):
            model = AutoXLAModelForImageSegmentation.from_pretrained(
                seg_checkpoints["segformer"], attn_implementation="splash_attention")
    assert sum("bidirectional" in r.getMessage() for r in caplog.records) == 1
    got = _outputs(model, "segformer")
    assert_close(got["logits"], references["segformer"][1]["logits"], ATOL, RTOL)


def test_a_config_no_segmentation_class_maps(checkpoints, xla_devices):
    with pytest.raises(ValueError, match=r"LlamaConfig .* AutoModelForMaskGeneration, "
                                         r"AutoModelForUniversalSegmentation"):
        AutoXLAModelForImageSegmentation.from_pretrained(checkpoints["llama"])


def test_from_model_refuses_bad_input(xla_devices):
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        AutoXLAModelForImageSegmentation.from_model("facebook/sam3")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['revision'\]"):
        AutoXLAModelForImageSegmentation.from_model(nn.Linear(2, 2), revision="main")


def test_plan_from_config_alone(seg_checkpoints):
    import subprocess
    import sys

    path = seg_checkpoints["sam"]
    code = ("import sys; from AutoXLA.cli import main; rc = main(['plan', sys.argv[1], "
            "'--strategy', '2d', '--devices', '8']); "
            "assert 'torch_xla' not in sys.modules; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SamModel" in r.stdout and "rel_pos_h" in r.stdout and "does not divide" in r.stdout


@pytest.mark.parametrize("family", [f for f in ("sam", "mask2former") if f in FAMILIES])
def test_xla_patch_linear(family, seg_checkpoints, references, xla_devices):
    # torch_xla's einsum linear (the SPMD helper), swapped in before sharding. Mask2Former also
    # keeps its prediction layers in a plain list, which must follow the swap.
    from torch_xla.distributed.spmd.xla_sharding import EinsumLinear

    model = AutoXLAModelForImageSegmentation.from_pretrained(
        seg_checkpoints[family], sharding_strategy="2d", xla_patch_linear=True)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, EinsumLinear) for m in linears)
    got = _outputs(model, family)
    for name, expected in references[family][1].items():
        assert_close(got[name], expected, ATOL, RTOL, what=f"{family} einsum {name}")


@pytest.mark.parametrize("family", [f for f in ("sam", "segformer") if f in FAMILIES])
def test_fsdpv2_wrap(family, seg_checkpoints, references, xla_devices):
    model = AutoXLAModelForImageSegmentation.from_pretrained(
        seg_checkpoints[family], sharding_strategy="fsdp", use_fsdp_wrap=True)
    assert type(model).__name__ == "SpmdFullyShardedDataParallel"
    wrapped = [m for m in model.modules() if type(m).__name__ == "SpmdFullyShardedDataParallel"]
    assert len(wrapped) > 1, "only the root was wrapped: no layer classes were found"
    got = _outputs(model, family)
    for name, expected in references[family][1].items():
        assert_close(got[name], expected, ATOL, RTOL, what=f"{family} FSDPv2 {name}")
