"""The original AutoXLA's QuantizationConfig keywords and helpers (issue 13), on the CPU."""
import copy
import inspect
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from AutoXLA import _native
from AutoXLA.quantization import (LanguageModelQuantizer, ModelQuantizer, QuantizationConfig,
                                  get_model_size, pack_int4_to_int8, quantize_llm,
                                  quantize_llm_blockwise, quantize_llm_int4, quantize_llm_int8,
                                  unpack_int8_to_int4)
from AutoXLA.quantization import config as config_module
from AutoXLA.quantization.backends import choose
from AutoXLA.quantization.config import DEFAULT_BLOCK, FORMAT_VERSION

# The keys a version-1 checkpoint's quantization_config holds (written before these keywords).
V1_KEYS = {"n_bits", "block_size", "symmetric", "quantize_activation", "use_pallas",
           "exclude_layers", "quantize_lm_head", "backend", "quant_method", "format_version"}


@pytest.fixture
def fresh_warnings():
    """Forget which once-per-process keyword warnings were given, so a test sees its own."""
    config_module._WARNED.clear()
    yield
    config_module._WARNED.clear()


# -- per_channel ---------------------------------------------------------------------------
def test_per_channel_follows_or_sets_block_size():
    assert QuantizationConfig().per_channel is True
    assert QuantizationConfig(block_size=64).per_channel is False
    assert QuantizationConfig(per_channel=True).block_size == -1
    blockwise = QuantizationConfig(per_channel=False)
    assert blockwise.block_size == DEFAULT_BLOCK == 32 and blockwise.per_channel is False
    assert QuantizationConfig(per_channel=False, block_size=128).block_size == 128
    assert blockwise.layer_format("x", 64, 8).groups == 2
    with pytest.raises(ValueError, match="per_channel=True contradicts block_size=64"):
        QuantizationConfig(per_channel=True, block_size=64)
    with pytest.raises(ValueError, match="per_channel must be True, False or None"):
        QuantizationConfig(per_channel="yes")
    # A width the default block does not divide (the qwen3 fixture's 77): a last block of 13.
    assert blockwise.layer_format("mlp.down_proj", 77, 64).label == "int8 block 32 (last 13) sym"


# -- saving ----------------------------------------------------------------------------------
def test_saved_configs_stay_version_1_unless_tables_are_quantized():
    old = {"n_bits": 4, "block_size": 64, "symmetric": False, "quantize_activation": False,
           "use_pallas": None, "exclude_layers": [], "quantize_lm_head": False,
           "backend": "auto", "quant_method": "autoxla", "format_version": 1}
    loaded = QuantizationConfig.from_dict(old)            # a checkpoint saved before the keywords
    assert loaded.quantize_embeddings is False and loaded.use_xla_kernel is True
    assert loaded.to_dict() == old                        # and it is written back the same
    # per_channel is folded into block_size; pack_4bit and auto_tune_block_sizes store nothing.
    d = QuantizationConfig(per_channel=False, n_bits=4, scale_search=False).to_dict()
    assert set(d) == V1_KEYS and d["block_size"] == 32 and d["format_version"] == FORMAT_VERSION
    new = QuantizationConfig(quantize_embeddings=True, use_xla_kernel=False)
    d = new.to_dict()
    assert d["format_version"] == 2 and d["quantize_embeddings"] is True
    assert d["use_xla_kernel"] is False and QuantizationConfig.from_dict(d) == new
    with pytest.raises(ValueError, match="format_version 1 has no quantized embeddings"):
        QuantizationConfig.from_dict({**d, "format_version": 1})
    assert not QuantizationConfig().same_weights_as(QuantizationConfig(quantize_embeddings=True))


# -- use_xla_kernel --------------------------------------------------------------------------
def test_use_xla_kernel_false_skips_the_xla_op():
    fmt = QuantizationConfig().layer_format("q", 64, 64)     # int8 per-channel: xla_op can run it
    assert choose(fmt, QuantizationConfig(), on_tpu=False)[0] == "xla_op"
    backend, passed = choose(fmt, QuantizationConfig(use_xla_kernel=False), on_tpu=False)
    assert backend == "fallback" and "xla_op: use_xla_kernel=False" in passed
    # It says nothing about the Pallas kernel, which comes first on a TPU.
    assert choose(fmt, QuantizationConfig(use_xla_kernel=False), on_tpu=True)[0] == "pallas"
    with pytest.raises(ValueError, match="backend='xla_op'.*contradicts use_xla_kernel=False"):
        QuantizationConfig(backend="xla_op", use_xla_kernel=False)


# -- pack_4bit and auto_tune_block_sizes -----------------------------------------------------
@pytest.mark.parametrize("keyword,kwargs,match", [
    ("pack_4bit", dict(n_bits=4, pack_4bit=False), "int4 weights are always stored packed"),
    ("auto_tune_block_sizes", dict(auto_tune_block_sizes=False),
     "only with the tiles torch_xla tuned"),
])
def test_keywords_without_effect_warn_once(keyword, kwargs, match, fresh_warnings):
    with pytest.warns(UserWarning, match=match):
        QuantizationConfig(**kwargs)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        QuantizationConfig(**kwargs)
        QuantizationConfig(**{keyword: True})              # the behaviour: never a warning
        QuantizationConfig(n_bits=8, pack_4bit=False)      # int8 is unpacked here as there
    assert not [w for w in again if keyword in str(w.message)], [str(w.message) for w in again]


def test_the_pallas_kernel_picks_its_own_block_sizes():
    # Why AutoXLA calls torch_xla's kernel itself (backend.pallas_quantized_matmul) with tiles
    # from the tuned table (pallas_tiles.py): torch_xla's op replaces any block sizes it is given
    # by its table's and falls back to XLA's matmul on a miss. If this changes, the op could be
    # called again.
    from torch_xla.experimental import custom_kernel

    src = inspect.getsource(custom_kernel.quantized_matmul_int8)
    assert "batch_block_size, out_block_size, in_block_size = get_tuned_block_sizes(" in src


# -- helpers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("helper,kwargs,expected", [
    (quantize_llm, dict(n_bits=4, block_size=64, symmetric=False),
     QuantizationConfig(n_bits=4, block_size=64, symmetric=False, use_pallas=False)),
    (quantize_llm_int8, {}, QuantizationConfig(n_bits=8, quantize_activation=True, use_pallas=False)),
    (quantize_llm_int4, {}, QuantizationConfig(n_bits=4, block_size=-1, quantize_activation=True,
                                               use_pallas=False)),
    (quantize_llm_blockwise, dict(block_size=64),
     QuantizationConfig(n_bits=4, block_size=64, use_pallas=False)),
], ids=["quantize_llm", "int8", "int4", "blockwise"])
def test_helpers_are_model_quantizer(helper, kwargs, expected, reference_models):
    float_model = reference_models("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # activations stay float on the CPU fallback
        got = helper(copy.deepcopy(float_model), **kwargs)
        want = ModelQuantizer(expected).quantize_model(copy.deepcopy(float_model))
    assert got.autoxla_quantization.config == expected
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, want(input_ids=ids).logits)


def test_get_model_size_counts_parameters_and_buffers():
    net = nn.Sequential(nn.Linear(64, 32))                 # fp32: (64*32 + 32) * 4 bytes
    assert get_model_size(net) == {"param_size_mb": 8320 / 2**20, "buffer_size_mb": 0.0,
                                   "total_size_mb": 8320 / 2**20}
    ModelQuantizer(QuantizationConfig()).quantize_model(net)
    # int8 weight 32*64 bytes + bf16 scales 32*2 as buffers; the fp32 bias stays a parameter.
    size = ModelQuantizer.get_model_size(net)
    assert size == {"param_size_mb": 128 / 2**20, "buffer_size_mb": 2112 / 2**20,
                    "total_size_mb": 2240 / 2**20}
    assert LanguageModelQuantizer.get_model_size is ModelQuantizer.get_model_size


def _numpy_pack(values: np.ndarray) -> np.ndarray:
    """The original's layout, from its description: flatten, pad an odd count with 0, store
    value + 8, element 2j in the low nibble and 2j+1 in the high one, as int8."""
    flat = values.reshape(-1).astype(np.int64)
    if flat.size % 2:
        flat = np.concatenate([flat, [0]])
    nib = (flat + 8).astype(np.uint8)
    return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8).view(np.int8)


@pytest.mark.parametrize("shape", [(16,), (4, 8), (3, 5), (1, 1), (0, 4)])
def test_int4_pack_round_trip_and_layout(shape):
    n = int(np.prod(shape))
    values = (torch.arange(n) % 16 - 8).to(torch.int8).reshape(shape)   # all 16 values, in turn
    packed, got_shape = pack_int4_to_int8(values)
    assert got_shape == values.shape and packed.dtype == torch.int8 and packed.numel() == (n + 1) // 2
    assert np.array_equal(packed.numpy(), _numpy_pack(values.numpy()))
    assert torch.equal(unpack_int8_to_int4(packed, got_shape), values)
    assert torch.equal(unpack_int8_to_int4(packed.view(torch.uint8), got_shape), values)


def test_int4_pack_golden_bytes_and_c_engine_layout():
    # Golden bytes: (-8, 7) -> nibbles 0 and 15 -> 0xF0; (0, 1) -> 8 | 9 << 4 = 0x98.
    packed, _ = pack_int4_to_int8(torch.tensor([-8, 7, 0, 1]))
    assert packed.view(torch.uint8).tolist() == [0xF0, 0x98]
    # The C engine stores two's complement nibbles per row: asymmetric int4 over a row holding
    # -8 and 7 has scale 1 and zero point 0, so its q is the values themselves. Same pair order,
    # every nibble's top bit flipped: original byte = C byte ^ 0x88 (docs/quantization.md).
    g = torch.Generator().manual_seed(0)
    rows = torch.stack([torch.randperm(16, generator=g) - 8 for _ in range(6)]).to(torch.int8)
    c = _native.quantize(rows.float(), bits=4, symmetric=False, block_size=16, stats=False)
    assert torch.all(c.scale.float() == 1) and torch.all(c.zero_point == 0)
    ours, _ = pack_int4_to_int8(rows)
    assert torch.equal(ours.view(torch.uint8).reshape(6, 8), c.q ^ 0x88)


def test_int4_pack_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match=r"values in \[-8, 7\], got values in \[0, 15\]"):
        pack_int4_to_int8(torch.arange(16))
    with pytest.raises(ValueError, match="integer tensor"):
        pack_int4_to_int8(torch.zeros(4))
    packed, shape = pack_int4_to_int8(torch.zeros(6, dtype=torch.int8))
    with pytest.raises(ValueError, match="3 packed bytes cannot hold 8 values"):
        unpack_int8_to_int4(packed, (2, 4))
