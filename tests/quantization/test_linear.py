"""QuantizedLinear on the CPU: the in-graph int4 unpacking, dequantization, and the backends.

The XLA-device behaviour (sharded) is in test_quantized_loading.py; here the same module runs on
CPU tensors, where torch.ops.xla.quantized_matmul has a CompositeExplicitAutograd kernel.
"""
import pytest
import torch

from AutoXLA import _native
from AutoXLA.quantization import QuantizationConfig
from AutoXLA.quantization.backends import choose, pallas_arguments, xla_op_arguments
from AutoXLA.quantization.linear import QuantizedLinear
from AutoXLA.quantization.packing import dequantize, unpack_int4
from AutoXLA.quantization.weights import quantize_tensor

SCALE_DTYPE = torch.bfloat16     # the default format's scales

FORMATS = [  # (n_bits, block_size, symmetric)
    (8, -1, True), (8, -1, False), (8, 32, True), (8, 64, False),
    (4, -1, True), (4, -1, False), (4, 32, True), (4, 64, False),
]


def test_unpack_int4_golden_bytes():
    # Element 2j in the low nibble, 2j+1 in the high nibble, 4-bit two's complement; an odd
    # row's last high nibble is padding. The C engine's packing of the same values is pinned in
    # csrc/tests; here the reverse direction, as the device graph runs it.
    packed = torch.tensor([[0x21, 0x8F, 0x07]], dtype=torch.uint8)
    assert unpack_int4(packed, 5).tolist() == [[1, 2, -1, -8, 7]]
    assert unpack_int4(packed, 6).tolist() == [[1, 2, -1, -8, 7, 0]]


@pytest.mark.parametrize("bits,block,sym", FORMATS)
def test_torch_dequantize_equals_c_engine(bits, block, sym):
    # The device-side dequantization (torch ops) and the C engine's must agree exactly in fp32:
    # both widen the bf16 scale and compute (q - zp) * scale with one fp32 multiply.
    torch.manual_seed(bits * 100 + block)
    w = torch.randn(24, 192) * 0.3
    fmt = QuantizationConfig(n_bits=bits, block_size=block, symmetric=sym).layer_format("w", 192, 24)
    q = _native.quantize(w, bits=bits, symmetric=sym, block_size=block, scale_dtype=SCALE_DTYPE)
    ours = dequantize(q.q, q.scale, q.zero_point, fmt, torch.float32)
    theirs = _native.dequantize(q.q, q.scale, q.zero_point, bits=bits, cols=192, block_size=block)
    assert torch.equal(ours, theirs)


def _layer(bits, block, sym, backend, act=False, in_f=192, out_f=24, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(out_f, in_f) * 0.3
    b = torch.randn(out_f)
    cfg = QuantizationConfig(n_bits=bits, block_size=block, symmetric=sym)
    fmt = cfg.layer_format("w", in_f, out_f)
    layer = QuantizedLinear(fmt, bias=True, backend=backend, quantize_activation=act)
    q = _native.quantize(w, bits=bits, symmetric=sym, block_size=block, scale_dtype=SCALE_DTYPE)
    layer.load_quantized(q.q, q.scale, q.zero_point, b)
    return layer, w, b


@pytest.mark.parametrize("bits,block,sym", FORMATS)
def test_fallback_equals_float64_matmul_of_dequantized_weight(bits, block, sym):
    layer, _, b = _layer(bits, block, sym, "fallback")
    x = torch.randn(3, 5, 192)
    w64 = layer.dequantized_weight(torch.float64)
    expected = x.double() @ w64.T + b.double()
    # fp32 matmul over 192 terms of magnitude ~1: error ~ sqrt(192) * 2^-24 * |sum| << 1e-4.
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-4, rtol=1e-5)
    assert layer.bias.dtype == torch.float32 and layer.bias.requires_grad


@pytest.mark.parametrize("sym", [True, False])
def test_xla_op_equals_fallback_per_channel_int8(sym):
    fb, _, _ = _layer(8, -1, sym, "fallback")
    op, _, _ = _layer(8, -1, sym, "xla_op")
    x = torch.randn(4, 192)
    # Same weights; the op scales after the matmul, the fallback before: fp32 reordering only.
    torch.testing.assert_close(op(x), fb(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend,sym,act", [("xla_op", True, False), ("xla_op", False, False),
                                              ("xla_op", True, True), ("torch_int8", True, True)])
def test_backends_without_a_backward_get_the_dequantized_matmuls_gradient(backend, sym, act):
    # torch_xla's quantized matmuls have no autograd kernel, and W8A8 rounds its activations
    # (a zero gradient): LoRA below such a layer would train on a wrong input gradient. Both get
    # the fallback's (x @ dequant(W).T + b); straight-through for the rounded activations. The
    # same dequantized weight on both sides, so fp32 reordering only.
    layer, _, _ = _layer(8, -1, sym, backend, act=act)
    ref, _, _ = _layer(8, -1, sym, "fallback")
    x = torch.randn(3, 5, 192, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    weights = torch.randn(3, 5, 24)
    (layer(x) * weights).sum().backward()
    (ref(x_ref) * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, atol=1e-5, rtol=1e-5)
    assert all(b.grad is None for b in layer.buffers())


def test_xla_op_activation_quantization_is_w8a8():
    op, _, _ = _layer(8, -1, True, "xla_op", act=True)
    fb, _, _ = _layer(8, -1, True, "fallback")
    x = torch.randn(4, 192)
    y, ref = op(x), fb(x)
    # Dynamic per-row int8 activations: error about |x|max/127/sqrt(12) per input, summed over 192
    # inputs of a weight ~0.3: relative error ~1%, never exact.
    rel = ((y - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.05, rel


def _w8a8_reference(layer, x):
    """torch_xla's W8A8 (its _quantize_tensor: row scale max|x| / 127 and the rounding, in
    fp32 as it does), then the exact integer products and the exact dequantized weight in
    float64: (xq @ (q - zp)^T) * s * x_scale + b."""
    x_scale = x.abs().amax(dim=-1, keepdim=True) / 127
    # (torch_xla divides an all-zero row by 0; its integers are then undefined: here 0. In bf16
    # a row's maximum can round to 128: saturated here, where torch_xla's CPU kernel wraps)
    xq = torch.round(x / torch.where(x_scale == 0, 1.0, x_scale)).clamp(-128, 127).double()
    w = dequantize(layer.weight, layer.weight_scale, layer.weight_zero_point, layer.quant_format,
                   torch.float64)    # (q - zp) * bf16 scale: exact in fp32, hence in float64
    out = (xq @ w.T) * x_scale.double() + layer.bias.double()
    # fp32 rounding of each term before the row scale (int32 sums below 2^24 convert exactly):
    # a few ulps of the sum of |terms|, which bounds the torch_int8 backend's error
    magnitude = (xq.abs() @ w.abs().T) * x_scale.double()
    return out, magnitude


@pytest.mark.parametrize("bits,sym,dtype", [(8, True, torch.float32), (8, False, torch.float32),
                                            (4, True, torch.float32), (4, False, torch.float32),
                                            (8, True, torch.bfloat16)])
def test_torch_int8_w8a8_equals_torch_xlas_arithmetic_in_float64(bits, sym, dtype):
    # The dtensor runtime's W8A8 (no torch_xla there): torch._int_mm on int8 activations
    # quantized in their own dtype (bf16 too, as torch_xla does)
    layer, _, _ = _layer(bits, -1, sym, "torch_int8", act=True)
    x = torch.randn(3, 5, 192).to(dtype)
    x[1, 2] = 0.0                       # an all-zero row: scale 0, output = the bias
    want, magnitude = _w8a8_reference(layer, x)
    got = layer(x)
    assert got.shape == (3, 5, 24)
    # fp32 sums, then the output in x's dtype (bf16: half an ulp, 2^-9 relative)
    rounding = 8 * 2**-24 if dtype == torch.float32 else 2**-8
    assert ((got.double() - want).abs() <= rounding * magnitude + 1e-6).all()
    assert torch.equal(got[1, 2], layer.bias.to(got.dtype))


def test_torch_int8_equals_torch_xlas_own_op():
    # torch_xla's quantized_matmul (its CPU kernel) with quantize_activation=True: the same
    # arithmetic in another order of the two fp32 scale multiplies (ulps). (In bf16 the two differ
    # where a row's maximum divided by its scale rounds to 128: torch_xla's CPU kernel
    # wraps it to -128, flipping the sign of the row's largest value; ours saturates at 127.
    # The bf16 case is checked against the float64 reference above.)
    ours, _, _ = _layer(8, -1, True, "torch_int8", act=True)
    theirs, _, _ = _layer(8, -1, True, "xla_op", act=True)
    x = torch.randn(4, 7, 192)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_torch_int8_is_chosen_for_w8a8_only_without_torch_xla(monkeypatch):
    from AutoXLA.quantization import backends

    cfg = QuantizationConfig(bits=8, quantize_activation=True)
    fmt = cfg.layer_format("q_proj", 192, 24)
    monkeypatch.setattr(backends.xla, "has_quantized_matmul", lambda: False)
    assert choose(fmt, cfg, False, "q_proj", torch.float32, True)[0] == "torch_int8"
    name, passed = choose(fmt, cfg, False, "q_proj", torch.float32, False)
    assert name == "fallback" and not any("torch_int8" in p for p in passed)   # not a candidate
    weights = QuantizationConfig(bits=8, backend="torch_int8")
    with pytest.raises(ValueError, match="weight-only: it is for int8 activations"):
        choose(fmt, weights, False, "q_proj", torch.float32, False)
    blocks = QuantizationConfig(bits=4, block_size=32, quantize_activation=True)
    name, passed = choose(blocks.layer_format("q_proj", 192, 24), blocks, False, "q_proj",
                          torch.float32, True)
    assert name == "fallback" and "per-channel formats only" in passed[-1]
    monkeypatch.undo()
    assert choose(fmt, cfg, False, "q_proj", torch.float32, True)[0] == "xla_op"


def test_xla_op_zero_point_is_premultiplied():
    layer, _, _ = _layer(8, -1, False, "xla_op")
    (x, w, scale), kw = xla_op_arguments(layer, torch.randn(2, 192))
    assert w.dtype == torch.int8 and scale.shape == (24,)
    expected = layer.weight_zero_point.reshape(-1).float() * scale
    assert torch.equal(kw["zero_point"], expected)


@pytest.mark.parametrize("bits", [8, 4])
def test_pallas_arguments(bits):
    # The kernel's arguments (tests/tpu_emulation runs the kernel itself): a 2-D x, an int8
    # (out, in) weight (int4 unpacked inside the graph to values in [-8, 7]), a (out,) scale,
    # and explicit tiles: off a TPU the untuned minimum (pallas_tiles.DEFAULT).
    layer, _, _ = _layer(bits, -1, True, "pallas", act=True)
    x = torch.randn(3, 5, 192)
    (x2, w, scale), kw = pallas_arguments(layer, x)
    assert x2.shape == (15, 192) and w.dtype == torch.int8 and w.shape == (24, 192)
    assert scale.shape == (24,) and kw == {"quantize_activation": True, "batch_block_size": 128,
                                           "out_block_size": 128, "in_block_size": 128}
    if bits == 4:
        assert w.min() >= -8 and w.max() <= 7
    fb, _, _ = _layer(bits, -1, True, "fallback")
    torch.testing.assert_close((x2 @ w.float().T) * scale, fb(x).reshape(15, 24) - fb.bias,
                               atol=1e-4, rtol=1e-4)


def test_pallas_on_a_known_tpu_generation_needs_torch_xlas_tuned_tiles():
    # torch_xla's table (v6, bf16, int8 activations) has a (4096, 4096) layer; it has no v5
    # entries at all, so there the layer takes XLA's quantized matmul, said in passed_over.
    from AutoXLA.quantization import pallas_tiles

    cfg = QuantizationConfig(n_bits=8, quantize_activation=True)
    fmt = cfg.layer_format("q_proj", 4096, 4096)
    assert choose(fmt, cfg, 6, "q_proj", torch.bfloat16, True) == ("pallas", [])
    name, passed = choose(fmt, cfg, 5, "q_proj", torch.bfloat16, True)
    assert name == "xla_op" and "tuned no tiles for a (4096, 4096) layer on TPU v5" in passed[0]
    assert choose(fmt, cfg, 6, "q_proj", torch.float32, True)[0] == "xla_op"
    assert pallas_tiles.tuned_generations(4096, 4096, torch.bfloat16, True) == (6,)
    # The nearest tuned token count at or above the call's: 1 token takes the 16-token tiles.
    table = pallas_tiles.table()
    assert pallas_tiles.tiles(6, 1, 4096, 4096, torch.bfloat16, True) == \
        table[(6, 16, 4096, 4096, "bfloat16", True)]
    assert pallas_tiles.tiles(6, 10**6, 4096, 4096, torch.bfloat16, True) == \
        table[(6, max(k[1] for k in table if k[2:4] == (4096, 4096)), 4096, 4096, "bfloat16", True)]
    assert pallas_tiles.tiles(None, 5, 24, 192, torch.float32, False) == pallas_tiles.DEFAULT


@pytest.mark.parametrize("bits,block,sym,on_tpu,use_pallas,expected", [
    (8, -1, True, True, None, "pallas"),
    (8, -1, True, True, True, "pallas"),
    (4, -1, True, True, None, "pallas"),
    (8, -1, True, True, False, "xla_op"),
    (8, -1, True, False, True, "xla_op"),
    (8, -1, False, True, None, "xla_op"),
    (8, 64, True, True, None, "fallback"),
    (4, -1, True, False, None, "fallback"),
    (4, 64, False, True, None, "fallback"),
])
def test_backend_preference(bits, block, sym, on_tpu, use_pallas, expected):
    cfg = QuantizationConfig(n_bits=bits, block_size=block, symmetric=sym, use_pallas=use_pallas)
    fmt = cfg.layer_format("l", 128, 16)
    name, passed_over = choose(fmt, cfg, on_tpu)
    assert name == expected
    assert len(passed_over) == ("pallas", "xla_op", "fallback").index(expected)


def test_explicit_backend_that_cannot_run_is_an_error():
    cfg = QuantizationConfig(n_bits=4, block_size=-1, backend="xla_op")
    with pytest.raises(ValueError, match=r"backend='xla_op' cannot run layer 'mlp' \(int4 per-channel "
                                         r"sym, searched\): torch_xla's int4 path copies the weight"):
        choose(cfg.layer_format("mlp", 64, 8), cfg, on_tpu=False, layer="mlp")
    cfg = QuantizationConfig(n_bits=8, backend="pallas")
    with pytest.raises(ValueError, match="runs only on a TPU"):
        choose(cfg.layer_format("mlp", 64, 8), cfg, on_tpu=False, layer="mlp")


# The formats issue 14 added: a float offset, float16 scales, a ragged last block, searched scales.
NEW_FORMATS = [  # QuantizationConfig keywords
    dict(n_bits=4, block_size=32, symmetric=False, zero_point="float"),
    dict(n_bits=8, block_size=-1, symmetric=False, zero_point="float", scale_dtype="float16"),
    dict(n_bits=4, block_size=40, symmetric=True, scale_search=True),        # 192 = 4 x 40 + 32
    dict(n_bits=4, block_size=40, symmetric=False, zero_point="float", scale_search=True),
]


@pytest.mark.parametrize("kw", NEW_FORMATS, ids=lambda kw: QuantizationConfig(**kw)
                         .layer_format("w", 192, 1).label)
def test_torch_dequantize_equals_c_engine_new_formats(kw):
    # As above: the same fp32 operations in the same order ((q - zp) * s, or q * s + offset).
    w = torch.randn(24, 192, generator=torch.Generator().manual_seed(7)) * 0.3
    fmt = QuantizationConfig(**kw).layer_format("w", 192, 24)
    q = quantize_tensor(w, fmt, stats=False)
    ours = dequantize(q.q, q.scale, q.zero_point, fmt, torch.float32, q.offset)
    theirs = _native.dequantize(q.q, q.scale, q.zero_point, bits=fmt.bits, cols=192,
                                block_size=fmt.block_size, offset=q.offset)
    assert torch.equal(ours, theirs)


def test_xla_op_equals_fallback_with_a_float_offset():
    kw = dict(n_bits=8, block_size=-1, symmetric=False, zero_point="float")
    w = torch.randn(24, 192, generator=torch.Generator().manual_seed(3)) * 0.3
    fmt = QuantizationConfig(**kw).layer_format("w", 192, 24)
    q = quantize_tensor(w, fmt, stats=False)
    layers = {}
    for backend_name in ("fallback", "xla_op"):
        layers[backend_name] = QuantizedLinear(fmt, bias=False, backend=backend_name)
        layers[backend_name].load_quantized(q.q, q.scale, None, offset=q.offset)
    x = torch.randn(4, 192)
    # The op adds x @ offset after the matmul, the fallback adds the offset to each weight first:
    # fp32 reordering only.
    torch.testing.assert_close(layers["xla_op"](x), layers["fallback"](x), atol=1e-4, rtol=1e-4)


def test_the_plan_says_where_each_pallas_layer_has_tuned_tiles():
    # Llama-3.1-8B W8A8 in bf16: the plan repeats torch_xla's table per Pallas layer (the
    # generations with tuned tiles; on the others a TPU takes the next backend).
    from AutoXLA.modeling.from_config import plan_from_config
    from AutoXLA.quantization import pallas_tiles

    path = "AutoXLA/data/model_configs/meta-llama--Llama-3.1-8B"
    cfg = QuantizationConfig(bits=8, quantize_activation=True)
    plan = plan_from_config(path, dtype="bfloat16", quantization_config=cfg)
    by_name = {t.name: t for t in plan.tensors}
    q = by_name["model.layers.0.self_attn.q_proj.weight"]
    assert q.backend == "pallas" and q.pallas_tuned == (6,)   # (4096, 4096) is in the table
    assert "tuned tiles on TPU v6" in str(plan)
    for t in plan.tensors:
        if t.backend == "pallas":
            out, inp = t.source_shape
            assert t.pallas_tuned == pallas_tiles.tuned_generations(out, inp, torch.bfloat16,
                                                                   True), t.name
