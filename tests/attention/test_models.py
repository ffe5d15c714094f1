"""The kernels inside every decoder family, on 8 devices, against transformers' eager attention.

Off TPU both names run the portable blockwise path; these tests use 4-token blocks so that the
12- and 40-token sequences span several blocks and the causal and window skipping is exercised.
"""
import numpy as np
import pytest
import torch

from AutoXLA import backend
from AutoXLA.attention import KERNELS
from AutoXLA.attention.hf import LayerAttention
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.testing.tiny import available_families
from tests.helpers import assert_close, embeds_and_q_proj_grads

FAMILIES = available_families()
SMALL_BLOCKS = {"sa_block_q": 4, "sa_block_kv": 4}
WINDOWED = [f for f in ("mistral", "gemma2") if f in FAMILIES]
# Gradients flow back through 2 layers in fp32 on both sides; the online softmax and the sharded
# reductions reorder sums of ~1e3 terms, each reordering costing a few ulps (1.2e-7) of the
# largest term. So the error scales with the tensor's largest entry (up to ~1e2 for a weight
# gradient), not with each entry: allow 2e-5 of the largest entry (observed 1.6e-6), while a
# wrong mask or window changes gradients by O(10%) of it.
GRAD_FRACTION_OF_MAX, GRAD_RTOL = 2e-5, 1e-4


def _load(path, kernel, strategy="2d", **kwargs):
    return AutoXLAModelForCausalLM.from_pretrained(
        path, sharding_strategy=strategy, attn_implementation=kernel,
        attention_config=kwargs.pop("attention_config", SMALL_BLOCKS), **kwargs)


def _logits(model, ids, mask=None):
    dev = backend.device()
    with torch.no_grad():
        out = model(input_ids=ids.to(dev),
                    attention_mask=None if mask is None else mask.to(dev)).logits
    return out.cpu()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_eager_with_left_padding(family, kernel, checkpoints, reference_models,
                                              batch, xla_devices, monkeypatch):
    ids, mask = batch
    model = _load(checkpoints[family], kernel)
    calls = _spy_on_blockwise(monkeypatch)
    expected = reference_models(family)(input_ids=ids, attention_mask=mask).logits.detach()
    got = _logits(model, ids, mask)
    valid = mask.bool()   # padded positions are not outputs anyone reads
    assert_close(got[valid], expected[valid], what=f"{family}/{kernel} logits")
    # Every layer ran the portable path with the kernels' own description of the mask (causal,
    # the layer's window, padding as segment ids), not a dense mask: so blocks were skipped.
    config = model.config
    # Layers are windowed where layer_types says so; without layer_types (Mistral), all are.
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    windows = [getattr(config, "sliding_window", None) if t == "sliding_attention" else None
               for t in types]
    # A scanned stack traces its loop body once: one call per layer of a step (its group).
    stack = model.autoxla_plan.stack
    if stack.scanned:
        assert model.model.layers.last_mode == "scanned"
        windows = windows[:stack.group]
    assert calls == [dict(causal=True, window=w, dense=False, segments=True) for w in windows]


def _spy_on_blockwise(monkeypatch):
    from AutoXLA.attention import hf

    calls, real = [], hf.blockwise_attention

    def spy(*args, **kwargs):
        calls.append(dict(causal=kwargs["causal"], window=kwargs["window"],
                          dense=kwargs["mask"] is not None,
                          segments=kwargs["q_segment_ids"] is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "blockwise_attention", spy)
    return calls


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_long_sequence_equals_eager(family, kernel, checkpoints, reference_models, xla_devices):
    # 40 tokens: longer than the 6-token sliding windows, 10 blocks of 4.
    ids = torch.arange(3, 43).remainder(200).unsqueeze(0) + 3
    expected = reference_models(family)(input_ids=ids).logits.detach()
    got = _logits(_load(checkpoints[family], kernel), ids)
    assert_close(got, expected, what=f"{family}/{kernel} logits, 40 tokens")


@pytest.mark.parametrize("family", WINDOWED)
def test_local_layers_really_use_the_window(family, checkpoints, reference_models, xla_devices):
    # The window must matter on this input (else the long-sequence test proves nothing about it):
    # the same weights with the window widened past the sequence give clearly different logits.
    from transformers import AutoModelForCausalLM

    ids = torch.arange(3, 43).unsqueeze(0)
    windowed = reference_models(family)(input_ids=ids).logits.detach()
    full = AutoModelForCausalLM.from_pretrained(
        checkpoints[family], dtype=torch.float32, attn_implementation="eager",
        sliding_window=4096).eval()(input_ids=ids).logits.detach()
    assert (windowed - full).abs().max() > 1e-2, "the sliding window does not change the logits"
    got = _logits(_load(checkpoints[family], "splash_attention"), ids)
    assert_close(got, windowed, what=f"{family} windowed logits")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_eager(family, kernel, checkpoints, reference_models, batch, xla_devices):
    ids, mask = batch
    reference = reference_models(family)
    model = _load(checkpoints[family], kernel)
    weights = torch.randn(*ids.shape, reference.config.vocab_size,
                          generator=torch.Generator().manual_seed(0)) * mask[..., None]

    expected = embeds_and_q_proj_grads(reference, ids, mask, weights, "cpu")
    got = embeds_and_q_proj_grads(model, ids, mask, weights, backend.device())
    valid = mask.bool()
    for what, g, e in (("d/d embeds", got[0][valid], expected[0][valid]),
                       ("d/d q_proj", got[1], expected[1])):
        atol = GRAD_FRACTION_OF_MAX * e.abs().max().item()
        assert_close(g, e, atol, GRAD_RTOL, f"{family}/{kernel} {what}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_16_tokens_equals_eager(family, kernel, checkpoints, reference_models,
                                                batch, xla_devices):
    ids, mask = batch
    args = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = reference_models(family).generate(input_ids=ids, attention_mask=mask, **args)
    model = _load(checkpoints[family], kernel)
    dev = backend.device()
    got = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args).cpu()
    assert torch.equal(got, expected), f"{family}/{kernel}: {got.tolist()} != {expected.tolist()}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_same_shapes_compile_once(kernel, checkpoints, batch, xla_devices):
    ids, mask = batch
    model = _load(checkpoints["gemma2" if "gemma2" in FAMILIES else "llama"], kernel)
    dev = backend.device()
    other = torch.where(mask.bool(), (ids * 7 + 1) % 250 + 3, ids)   # new values, same shapes
    with torch.no_grad():
        # Two warm-up calls: the first one's graph also holds the pending input transfers.
        for _ in range(2):
            model(input_ids=ids.to(dev), attention_mask=mask.to(dev))
            backend.sync()
        compiles = backend.compile_count()
        for x in (ids, other):
            model(input_ids=x.to(dev), attention_mask=mask.to(dev))
            backend.sync()
    assert backend.compile_count() == compiles, "a forward with the same shapes compiled again"


def test_selected_layers_only(checkpoints, reference_models, batch, xla_devices):
    ids, mask = batch
    model = _load(checkpoints["gemma2"], "splash_attention",
                  attention_config={**SMALL_BLOCKS, "layers": [1]})
    layers = [m.self_attn.autoxla_attention for m in model.model.layers]
    assert layers[0] is None and isinstance(layers[1], LayerAttention)
    expected = reference_models("gemma2")(input_ids=ids, attention_mask=mask).logits.detach()
    assert_close(_logits(model, ids, mask)[mask.bool()], expected[mask.bool()])


def _user_mesh(strategy):
    # What a user writes: a torch_xla Mesh with the axes AutoXLA shards over.
    import torch_xla.distributed.spmd as xs

    shape = {"fsdp": (1, 8, 1), "2d": (1, 4, 2)}[strategy]
    return xs.Mesh(np.arange(8), shape, ("data", "fsdp", "model"))


@pytest.mark.parametrize("strategy", ["fsdp", "2d"])
def test_seed_splash_attention_example(strategy, checkpoints, reference_models, batch,
                                       xla_devices):
    path = str(checkpoints["llama"])
    mesh = _user_mesh(strategy)
    # --- from the seed (hub id -> local path; the strategy is the parameter) ---
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    # Create block sizes
    sa_blocks = {
        "sa_block_q": 512,
        "sa_block_kv": 512,
        "sa_block_kv_compute": 512,
        "sa_block_q_dkv": 512,
        "sa_block_kv_dkv": 512,
        "sa_block_kv_dkv_compute": 512,
        "sa_block_q_dq": 512,
        "sa_block_kv_dq": 512,
        "mesh": str(mesh)
    }
    model = AutoXLAModelForCausalLM.from_pretrained(
        path,
        attn_implementation="splash_attention",
        attention_config=sa_blocks,
        sharding_strategy=strategy,
    )
    # --- end of the seed's code ---
    ids, mask = batch
    expected = reference_models("llama")(input_ids=ids, attention_mask=mask).logits.detach()
    assert_close(_logits(model, ids, mask)[mask.bool()], expected[mask.bool()])
    cfg = model.model.layers[0].self_attn.autoxla_attention.config
    assert cfg.mesh == str(mesh) and cfg.sa_block_q == 512


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(attention_config={"sa_block_qq": 8}), ValueError,
     r"unknown attention_config key\(s\) \['sa_block_qq'\]; valid keys: .*sa_block_q"),
    (dict(attention_config={"sa_block_q": 0}), ValueError, r"sa_block_q.*positive int"),
    (dict(attention_config={"layers": [5]}), ValueError, r"names layer 5.*2 layers"),
    (dict(attention_config={"mesh": "not a mesh"}), ValueError, r"str\(mesh\)"),
    (dict(attention_config={"qkv_partition_spec": ("fsdp", None)}), ValueError, "4 entries"),
    (dict(attention_config=[512]), TypeError, "attention_config must be a dict"),
    # An unknown key is refused even when eager attention would not use the config (eager with
    # a valid config only warns: tests/compat/test_options.py).
    (dict(attn_implementation="eager", attention_config={"sa_block_qq": 8}), ValueError,
     r"unknown attention_config key"),
    (dict(attn_implementation="flash_attention_2"), ValueError,
     r"unknown attn_implementation 'flash_attention_2'; use one of eager, xla_flash_attention"),
])
def test_bad_attention_arguments(kwargs, error, match, checkpoints, xla_devices):
    kwargs = {"attn_implementation": "splash_attention", **kwargs}
    with pytest.raises(error, match=match):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], **kwargs)


def test_mesh_string_must_describe_the_model_mesh(checkpoints, xla_devices):
    import torch_xla.distributed.spmd as xs

    other = xs.Mesh(np.arange(8)[::-1].copy(), (1, 8, 1), ("data", "fsdp", "model"))
    with pytest.raises(ValueError, match=r"model is sharded over .*same mesh"):
        _load(checkpoints["llama"], "splash_attention", strategy="fsdp",
              attention_config={"mesh": str(other)})
    # Without a data axis (the original AutoXLA's meshes) the string describes its three-axis
    # form: fsdp's mesh, so accepted there and refused under 2d.
    no_data = xs.Mesh(np.arange(8), (8, 1), ("fsdp", "model"))
    _load(checkpoints["llama"], "splash_attention", strategy="fsdp",
          attention_config={"mesh": str(no_data)})
    with pytest.raises(ValueError, match=r"model is sharded over .*same mesh"):
        _load(checkpoints["llama"], "splash_attention", strategy="2d",
              attention_config={"mesh": str(no_data)})


def test_splash_attention_config_object_is_accepted(checkpoints, xla_devices):
    from torch_xla.experimental.splash_attention import SplashAttentionConfig

    cfg = SplashAttentionConfig(sa_block_q=4, sa_block_kv=8)
    model = _load(checkpoints["llama"], "splash_attention", attention_config=cfg)
    layer = model.model.layers[0].self_attn.autoxla_attention
    assert (layer.config.sa_block_q, layer.config.sa_block_kv) == (4, 8)
    assert layer.config.mesh == str(model.autoxla_mesh)


@pytest.mark.parametrize("kernel", KERNELS)
def test_training_under_fsdpv2_with_checkpointing(kernel, checkpoints, reference_models,
                                                  xla_devices):
    # The kernels inside FSDPv2-wrapped, checkpointed decoder layers: the same loss as eager
    # transformers, and two AdamW steps that lower it (the backward pass runs through them).
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (8, 16), generator=g)
    with torch.no_grad():
        expected = reference_models("gemma2")(input_ids=ids, labels=ids).loss.item()
    model = _load(checkpoints["gemma2"], kernel, strategy="fsdp", use_fsdp_wrap=True,
                  gradient_checkpointing=True)
    model.train()
    dev = backend.device()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(input_ids=ids.to(dev), labels=ids.to(dev)).loss
        loss.backward()
        opt.step()
        backend.sync()
        losses.append(loss.item())
    # A mean of fp32 log-softmax terms: errors ~1e-6 on a loss of ~5 (tests/modeling/test_training.py).
    assert abs(losses[0] - expected) <= 1e-4, (losses[0], expected)
    assert losses[-1] < losses[0], losses


def test_the_briefs_headline_call(checkpoints, batch, xla_devices):
    # 2d sharding + splash attention + int8 quantization with use_pallas, in one call: logits equal
    # the same quantized model with eager attention (attention is the only difference).
    import warnings

    from AutoXLA.quantization import QuantizationConfig

    ids, mask = batch
    path = checkpoints["llama"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Pallas runs only on a TPU": expected here
        model = AutoXLAModelForCausalLM.from_pretrained(
            path, sharding_strategy="2d", attn_implementation="splash_attention", do_quant=True,
            quantization_config=QuantizationConfig(bits=8, use_pallas=True))
        eager = AutoXLAModelForCausalLM.from_pretrained(
            path, sharding_strategy="2d", do_quant=True,
            quantization_config=QuantizationConfig(bits=8, use_pallas=True))
    valid = mask.bool()
    assert_close(_logits(model, ids, mask)[valid], _logits(eager, ids, mask)[valid])


def test_registered_names_work_in_plain_transformers(checkpoints, reference_models, batch):
    # The registration is transformers' own mechanism: a model loaded by transformers itself,
    # on the CPU, can ask for the kernels by their registered names (the portable path runs).
    from transformers import AutoModelForCausalLM

    from AutoXLA.attention.config import TRANSFORMERS_NAMES
    from AutoXLA.attention.hf import register

    register()
    ids, mask = batch
    expected = reference_models("gemma2")(input_ids=ids, attention_mask=mask).logits.detach()
    for name in TRANSFORMERS_NAMES.values():
        model = AutoModelForCausalLM.from_pretrained(
            checkpoints["gemma2"], dtype=torch.float32, attn_implementation=name).eval()
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask).logits
        assert_close(got[mask.bool()], expected[mask.bool()], what=name)
