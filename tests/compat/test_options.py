"""The original AutoXLA's from_pretrained keywords, meshes and attention keys, as its users write
them (docs/migration.md). Numbers are checked against plain transformers on the CPU in fp32."""
import warnings

import numpy as np
import pytest
import torch

from AutoXLA import backend
from AutoXLA.attention import AttentionConfig
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.sharding.mesh import MeshShape

from ..helpers import assert_close

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _mesh(shape, names):
    import torch_xla.distributed.spmd as xs

    return xs.Mesh(np.arange(8), shape, names)


def _logits(model, ids, mask):
    dev = backend.device()
    with torch.no_grad():
        return model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()


# The original AutoXLA's own meshes (its _create_mesh): fsdp (8, 1) over (fsdp, model), dp over
# (data,), mp (1, 8) over (data, model), 2d over (fsdp, model); plus a permuted order.
ORIGINAL_MESHES = [((8, 1), ("fsdp", "model"), MeshShape(1, 8, 1)),
                   ((8,), ("data",), MeshShape(8, 1, 1)),
                   ((1, 8), ("data", "model"), MeshShape(1, 1, 8)),
                   ((2, 4), ("model", "fsdp"), MeshShape(1, 4, 2))]


@pytest.mark.parametrize("shape,names,expected", ORIGINAL_MESHES, ids=lambda v: str(v))
def test_mesh_with_a_subset_of_the_axes(shape, names, expected, checkpoints, reference_models,
                                        batch, xla_devices):
    ids, mask = batch
    user_mesh = _mesh(shape, names)
    # scan_layers=False: every layer's weights stay parameters of their own, to check below.
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], mesh=user_mesh,
                                                    scan_layers=False)
    assert model.autoxla_plan.mesh == expected
    assert tuple(model.autoxla_mesh.axis_names) == ("data", "fsdp", "model")
    valid = mask.bool()
    assert_close(_logits(model, ids, mask)[valid],
                 reference_models("llama")(input_ids=ids, attention_mask=mask).logits[valid])
    # Every device holds the shard the user's own mesh assigns it: annotating a fresh tensor on
    # the user's mesh (with the axes it has) gives the weight's exact sharding.
    checked = 0
    for t in model.autoxla_plan.parameters:
        spec = tuple(_only(a, names) for a in t.spec)
        if all(a is None for a in spec):
            continue
        fresh = torch.zeros(t.shape).to(backend.device())
        backend.mark_sharding(fresh, user_mesh, spec)
        backend.sync()
        assert backend.sharding_spec(model.get_parameter(t.name)) == backend.sharding_spec(fresh), t.name
        checked += 1
    assert checked >= 6 or expected == MeshShape(8, 1, 1)   # data parallel replicates weights


def _only(axes, names):
    """The axes of a plan spec entry that the user's mesh has (the others have size 1)."""
    if axes is None:
        return None
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a in names)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def test_attention_config_mesh_string_of_a_two_axis_mesh(checkpoints, reference_models, batch,
                                                         xla_devices):
    # The seed's "mesh": str(mesh), written from the original's (fsdp, model) mesh.
    ids, mask = batch
    user_mesh = _mesh((4, 2), ("fsdp", "model"))
    model = AutoXLAModelForCausalLM.from_pretrained(
        checkpoints["llama"], mesh=user_mesh, attn_implementation="splash_attention",
        attention_config={"sa_block_q": 4, "sa_block_kv": 4, "mesh": str(user_mesh)})
    valid = mask.bool()
    assert_close(_logits(model, ids, mask)[valid],
                 reference_models("llama")(input_ids=ids, attention_mask=mask).logits[valid])
    other = _mesh((2, 4), ("fsdp", "model"))
    with pytest.raises(ValueError, match=r"attention_config\['mesh'\].*sharded over"):
        AutoXLAModelForCausalLM.from_pretrained(
            checkpoints["llama"], mesh=user_mesh, attn_implementation="splash_attention",
            attention_config={"mesh": str(other)})


@pytest.mark.parametrize("names,sizes,match", [
    (("fsdp", "pipe"), (4, 2), r"unknown axes \['pipe'\]"),
    (("fsdp", "fsdp"), (4, 2), r"names axis \['fsdp'\] more than once"),
    (("fsdp",), (4,), r"covers 4 devices but the runtime has 8"),
])
def test_bad_user_meshes(names, sizes, match, checkpoints, xla_devices):
    with pytest.raises(ValueError, match=match):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], mesh=_FakeMesh(sizes, names))


class _FakeMesh:
    """Quacks like a Mesh with what torch_xla's Mesh itself refuses to build (repeated names, too
    few devices), as a mesh object from another library version might."""

    def __init__(self, sizes, names):
        self.mesh_shape, self.axis_names = sizes, names
        self.device_ids = np.arange(int(np.prod(sizes)))

    def get_op_sharding(self, *a):
        raise AssertionError("never used")


def test_original_attention_keywords(checkpoints, xla_devices):
    model = AutoXLAModelForCausalLM.from_pretrained(
        checkpoints["llama"], attn_implementation="Splash_Attention", sharding_strategy="2d",
        attention_layer_indices=[1], attention_partition_spec=("fsdp", "mp"), scan_layers=False)
    layers = model.model.layers
    assert layers[0].self_attn.autoxla_attention is None             # left eager
    cfg = layers[1].self_attn.autoxla_attention.config
    assert layers[1].self_attn.autoxla_attention.kernel == "splash_attention"
    # (batch, heads) of the original, completed for [batch, heads, seq, head_dim]; "mp" = model.
    assert cfg.qkv_partition_spec == ("fsdp", "model", None, None)
    assert cfg.layers == (1,)


@pytest.mark.parametrize("kwargs,match", [
    (dict(attention_layer_indices=[0], attention_config={"layers": [1]}), "disagree"),
    (dict(attention_partition_spec=("fsdp",)), "4 entries"),
    (dict(attention_layer_indices=[-1]), "layer indices"),
    (dict(attention_config={"SLIDE_WINDOW_SIZE": 4}), "takes effect only with"),
    (dict(attention_config={"AttentionType_LOCAL_SLIDING": True}), "needs 'SLIDE_WINDOW_SIZE'"),
    (dict(attention_config={"AttentionType_LOCAL_SLIDING": True, "SLIDE_WINDOW_SIZE": 4,
                            "slide_window_size": 3}), "same setting"),
])
def test_contradicting_attention_keywords(kwargs, match, checkpoints, xla_devices):
    with pytest.raises(ValueError, match=match):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"],
                                                attn_implementation="splash_attention", **kwargs)


def test_kernel_keywords_with_eager_attention_warn_once(checkpoints, caplog, xla_devices):
    from AutoXLA.attention import hf

    hf._WARNED.discard("eager-attention-config")
    with caplog.at_level("WARNING", logger="AutoXLA"):
        for _ in range(2):
            model = AutoXLAModelForCausalLM.from_pretrained(
                checkpoints["llama"], attention_config={"sa_block_q": 256},
                attention_layer_indices=[0])
    assert [r.getMessage() for r in caplog.records].count(
        next(r.getMessage() for r in caplog.records if "is 'eager': it is ignored" in r.getMessage())) == 1
    assert not hasattr(model.model.layers[0].self_attn, "autoxla_attention")


def test_attention_config_json_round_trip():
    cfg = AttentionConfig(sa_block_q=256, AttentionType_LOCAL_SLIDING=True, SLIDE_WINDOW_SIZE=4,
                          qkv_partition_spec=(("mp", "fsdp"), None, None, None), layers=[2, 0])
    assert AttentionConfig.from_json(cfg.to_json()) == cfg
    assert cfg.qkv_partition_spec == (("model", "fsdp"), None, None, None)
    assert (cfg.attentiontype_local_sliding, cfg.slide_window_size) == (True, 4)
    # torch_xla's LocalMask(w, w) admits q - w <= k: a query sees w + 1 keys, itself included.
    assert cfg.window(None) == 5 and cfg.window(3) == 3 and cfg.window(9) == 5
    with pytest.raises(ValueError, match="does not parse"):
        AttentionConfig.from_json("{not json")


@pytest.fixture(scope="module")
def mistral_with_user_window(checkpoints, xla_devices):
    """The mistral checkpoint (sliding_window=6 in its config) loaded with the window turned off
    in the config and put back through the original's splash keys: SLIDE_WINDOW_SIZE=5 keys
    before the query is transformers' sliding_window=6."""
    return AutoXLAModelForCausalLM.from_pretrained(
        checkpoints["mistral"], sliding_window=None, sharding_strategy="2d",
        attn_implementation="splash_attention",
        attention_config={"sa_block_q": 4, "sa_block_kv": 4,
                          "AttentionType_LOCAL_SLIDING": True, "SLIDE_WINDOW_SIZE": 5})


def test_sliding_window_keys_drive_the_kernel(mistral_with_user_window, checkpoints,
                                              reference_models, xla_devices):
    from ..generation.test_generate import prompts

    ids, mask = prompts()
    reference = reference_models("mistral")          # transformers with sliding_window=6
    valid = mask.bool()
    expected = reference(input_ids=ids, attention_mask=mask).logits
    assert_close(_logits(mistral_with_user_window, ids, mask)[valid], expected[valid])
    # The prompts are longer than the window, so without the keys the logits differ: the check
    # above can fail.
    no_window = AutoXLAModelForCausalLM.from_pretrained(
        checkpoints["mistral"], sliding_window=None, attn_implementation="splash_attention",
        attention_config={"sa_block_q": 4, "sa_block_kv": 4})
    diff = (_logits(no_window, ids, mask)[valid] - expected[valid]).abs().max()
    assert diff > 1e-2
    # Decoding over the static cache takes the dense-mask path: 32 tokens, far past the window.
    dev = backend.device()
    got = mistral_with_user_window.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                            max_new_tokens=32, **GREEDY).cpu()
    assert torch.equal(got, reference.generate(input_ids=ids, attention_mask=mask,
                                               max_new_tokens=32, **GREEDY))


def test_progress_bar_follows_verbose(checkpoints, capsys, xla_devices):
    # Not a terminal under pytest: the default (verbose=None) shows no bar, as tqdm decides.
    AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"])
    assert "AutoXLA: loading" not in capsys.readouterr().err
    AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], verbose=False)
    assert "AutoXLA: loading" not in capsys.readouterr().err
    AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], verbose=True)
    out = capsys.readouterr()
    assert "AutoXLA: loading" in out.err and "model.layers.0.self_attn.q_proj.weight" in out.out
    with pytest.raises(TypeError, match="verbose must be True, False or None"):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], verbose="yes")


def test_block_sizes_default_to_the_seeds_512():
    # The original's SplashAttentionConfig defaults to 256; the seed's example uses 512.
    cfg = AttentionConfig()
    assert {getattr(cfg, f) for f in ("sa_block_q", "sa_block_kv", "sa_block_kv_compute",
                                      "sa_block_q_dkv", "sa_block_kv_dkv", "sa_block_kv_dkv_compute",
                                      "sa_block_q_dq", "sa_block_kv_dq")} == {512}


def test_linears_named_output_are_quantized():
    # The original skipped every linear whose name contains "output" (BERT/ViT's
    # attention.output.dense) unless quantize_lm_head; only the real output embedding is skipped.
    from torch import nn

    from AutoXLA.quantization import ModelQuantizer, QuantizationConfig, QuantizedLinear

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.ModuleDict({"output": nn.ModuleDict({"dense": nn.Linear(64, 64)})})
            self.embed_proj = nn.Linear(64, 64)

    model = Block()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ModelQuantizer(QuantizationConfig(bits=8)).quantize_model(model)
    assert isinstance(model.attention["output"]["dense"], QuantizedLinear)
    assert isinstance(model.embed_proj, QuantizedLinear)
