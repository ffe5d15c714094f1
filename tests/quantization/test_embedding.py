"""quantize_embeddings: int8 tables from the C engine, gathered then dequantized, on 8 devices."""
import copy
import json
import warnings

import pytest
import torch
from torch import nn

from AutoXLA import backend
from AutoXLA.loading import checkpoint as ckpt
from AutoXLA.loading.streaming import read_whole
from AutoXLA.modeling import AutoXLAModelForCausalLM, AutoXLAModelForImageSegmentation
from AutoXLA.quantization import (ModelQuantizer, QuantizationConfig, QuantizedEmbedding,
                                  QuantizedLinear)
from AutoXLA.quantization.packing import dequantize
from AutoXLA.quantization.weights import quantize_tensor

from ..helpers import assert_close, check_sharding_matches_plan

TABLE = "model.embed_tokens"
# Only the table quantized: every decoder linear excluded, the lm head stays float by default.
TABLE_ONLY = QuantizationConfig(quantize_embeddings=True, exclude_layers=["model.layers"])
# Logits SQNR floor of the int8 table alone against the float model. Per-row int8 of a Gaussian
# row of 64: step absmax/127 ~ 2.4 sigma/127, noise step^2/12 -> ~39 dB per row; the two layers
# and the head amplify it somewhat on the way to the logits (measured 34.4 dB under fsdp and 2d).
# 30 dB leaves room and is still far above a wrong or misplaced table (~0 dB).
TABLE_SQNR_DB = 30.0


def _sqnr_db(ref, out):
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # use_pallas / activation notes off a TPU
        return AutoXLAModelForCausalLM.from_pretrained(path, **kw)


def _c_engine_table(checkpoints, cfg=TABLE_ONLY):
    """The checkpoint's float table through the C engine, and its float64 dequantization."""
    w = read_whole(ckpt.locate(checkpoints["llama"]).records[f"{TABLE}.weight"])
    fmt = cfg.embedding_format(*w.shape)
    q = quantize_tensor(w, fmt)
    deq = (q.q.double() - (0 if q.zero_point is None else q.zero_point.double())) * q.scale.double()
    return q, deq


@pytest.mark.parametrize("symmetric", [True, False])
def test_gather_equals_float64_dequantized_rows(symmetric):
    # int8 (or int8 minus an int8 zero point: 9 bits) times a bf16 scale (8-bit significand) fits
    # fp32's 24 bits, so the fp32 lookup is exact: equal to the float64 reference, not close.
    torch.manual_seed(0)
    w = torch.randn(40, 24) * torch.linspace(0.01, 3.0, 40).unsqueeze(1)   # rows of every scale
    cfg = QuantizationConfig(quantize_embeddings=True, symmetric=symmetric)
    emb = torch.nn.Embedding(40, 24)
    with torch.no_grad():
        emb.weight.copy_(w)
    net = torch.nn.Sequential(emb)
    ModelQuantizer(cfg).quantize_model(net)
    table = net[0]
    assert isinstance(table, QuantizedEmbedding) and table.weight.dtype == torch.int8
    assert tuple(table.weight_scale.shape) == (40, 1)
    assert (table.weight_zero_point is None) == symmetric
    q = quantize_tensor(w, cfg.embedding_format(40, 24))
    assert torch.equal(table.weight, q.q) and torch.equal(table.weight_scale, q.scale)
    ref = (q.q.double() - (0 if symmetric else q.zero_point.double())) * q.scale.double()
    ids = torch.tensor([[3, 0, 39, 3], [17, 17, 1, 38]])
    out = table(ids)
    assert out.dtype == torch.float32 and out.shape == (2, 4, 24)
    assert torch.equal(out.double(), ref[ids])
    # The same rows as the linears' dequantize of the whole table (which a lookup never builds).
    whole = dequantize(table.weight, table.weight_scale, table.weight_zero_point,
                       table.quant_format, torch.float32)
    assert torch.equal(out, whole[ids])
    # Float rows of the original within half a step of their own scale.
    assert ((out - w[ids]).abs() <= 0.5 * q.scale[ids].float() * (1 + 1e-6) + 1e-7).all()


def test_only_the_token_table_of_a_model_that_names_it():
    # A model with get_input_embeddings: its token table is quantized; another nn.Embedding that
    # it reads as `.weight` (as SAM does with its point and mask tokens) stays float, with why.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.queries = nn.Embedding(32, 16), nn.Embedding(4, 16)

        def get_input_embeddings(self):
            return self.tokens

        def forward(self, ids):
            return self.tokens(ids) + self.queries.weight.sum(0)

    torch.manual_seed(0)
    net = Net()
    ids = torch.tensor([[1, 5, 31]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # no note about activations: a lookup has no input
        ModelQuantizer(QuantizationConfig(quantize_embeddings=True, quantize_activation=True)
                       ).quantize_model(net)
    report = net.autoxla_quantization
    assert list(report.layers) == ["tokens"] and isinstance(net.tokens, QuantizedEmbedding)
    assert "not the token embedding table" in report.skipped["queries"]
    assert net.queries.weight.dtype == torch.float32
    expected = net.tokens(ids).double() + net.queries.weight.double().sum(0)
    assert_close(net(ids), expected, what="float queries beside the int8 table")
    assert "1 embedding table(s) quantized" in str(report)


@pytest.mark.parametrize("strategy", ["fsdp", "2d"])
def test_int8_table_sharded(strategy, checkpoints, reference_models, batch, xla_devices):
    ids, mask = batch
    model = _load(checkpoints["llama"], sharding_strategy=strategy, do_quant=True,
                  quantization_config=TABLE_ONLY)
    table = model.get_input_embeddings()
    assert isinstance(table, QuantizedEmbedding) and table.weight.device.type == "xla"
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    q, deq = _c_engine_table(checkpoints)
    assert torch.equal(table.weight.cpu(), q.q) and torch.equal(table.weight_scale.cpu(), q.scale)

    # The plan: the int8 table keeps the embedding spec, its per-row scale follows the vocab split.
    plan = model.autoxla_plan
    fsdp, mp = (8, 1) if strategy == "fsdp" else (4, 2)
    w, s = plan[f"{TABLE}.weight"], plan[f"{TABLE}.weight_scale"]
    assert (w.role, w.dtype, w.backend, w.source_shape) == ("vocab_embedding", "int8", "gather",
                                                             (256, 64))
    assert w.spec == ("fsdp", "model" if mp > 1 else None) and w.shard_shape == (256 // fsdp, 64 // mp)
    assert s.spec == ("fsdp", None) and s.derived_from == f"{TABLE}.weight"
    assert check_sharding_matches_plan(model, plan, model.autoxla_mesh) == (
        len(plan.parameters) + sum(1 for t in plan if t.quant))

    dev = backend.device()
    with torch.no_grad():
        # The lookup on the sharded table: exactly the float64 rows (see the test above).
        looked_up = table(ids.to(dev)).cpu()
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()
        ref = copy.deepcopy(reference_models("llama"))
        ref.get_input_embeddings().weight.copy_(deq.float())
        same_table = ref(input_ids=ids, attention_mask=mask).logits
        float_logits = reference_models("llama")(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(looked_up.double(), deq[ids])
    valid = mask.bool()
    # Transformers with the same (dequantized) table: only sharded fp32 reordering differs.
    assert_close(out[valid], same_table[valid], what=f"int8 table ({strategy}) vs same table")
    sqnr = _sqnr_db(float_logits[valid], out[valid])
    assert sqnr >= TABLE_SQNR_DB, f"logits SQNR {sqnr:.1f} dB against the float model"


@pytest.fixture(scope="module")
def quantized_llama(checkpoints, xla_devices):
    """Linears and the table quantized (int8), under fsdp."""
    return _load(checkpoints["llama"], sharding_strategy="fsdp", do_quant=True,
                 quantization_config=QuantizationConfig(quantize_embeddings=True))


def test_quantized_tables_save_reload_and_from_model(quantized_llama, checkpoints, reference_models,
                                                     batch, tmp_path):
    # Linears and the table quantized; saved, reloaded: identical logits. from_model on the same
    # float weights gives the same tensors, hence the same logits.
    ids, mask = batch
    dev = backend.device()
    cfg = QuantizationConfig(quantize_embeddings=True)
    model = quantized_llama
    with torch.no_grad():
        before = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()
    model.save_pretrained(tmp_path / "q")
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert saved["quantize_embeddings"] is True and saved["format_version"] == 2
    again = _load(tmp_path / "q", sharding_strategy="2d")   # loaded as saved, not re-quantized
    assert isinstance(again.get_input_embeddings(), QuantizedEmbedding)
    assert again.autoxla_quantization.config == cfg
    with torch.no_grad():
        after = again(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()
    valid = mask.bool()
    assert_close(after[valid], before[valid], what="reloaded vs saved (2d vs fsdp)")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = AutoXLAModelForImageSegmentation.from_model(
            copy.deepcopy(reference_models("llama")), sharding_strategy="fsdp", do_quant=True,
            quantization_config=cfg)
    table = built.get_input_embeddings()
    q, _ = _c_engine_table(checkpoints, cfg)
    assert isinstance(table, QuantizedEmbedding) and torch.equal(table.weight.cpu(), q.q)
    with torch.no_grad():
        got = built(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()
    assert_close(got[valid], before[valid], what="from_model vs from_pretrained")


def test_tied_table_stays_float_with_one_note(checkpoints, reference_models, batch, xla_devices):
    # Gemma2 ties lm_head to the table: the table is kept (one warning, in the report too), the
    # tie survives, and with the linears excluded the model is exactly transformers'.
    ids, mask = batch
    cfg = QuantizationConfig(quantize_embeddings=True, exclude_layers=["model.layers"])
    with pytest.warns(UserWarning, match="tied to the output projection") as record:
        model = AutoXLAModelForCausalLM.from_pretrained(
            checkpoints["gemma2"], sharding_strategy="fsdp", do_quant=True, quantization_config=cfg)
    assert sum("tied to the output projection" in str(w.message) for w in record) == 1
    report = model.autoxla_quantization
    assert "tie_word_embeddings" in report.skipped[TABLE]
    assert sum("tied" in n for n in report.warnings) == 1 and not report.layers
    table = model.get_input_embeddings()
    assert not isinstance(table, QuantizedEmbedding) and table.weight.dtype == torch.float32
    assert model.get_output_embeddings().weight is table.weight
    dev = backend.device()
    with torch.no_grad():
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()
        ref = reference_models("gemma2")(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert_close(out[valid], ref[valid], what="gemma2 with its tied table kept")


def test_generate_with_an_int8_table_equals_greedy_forwards(quantized_llama):
    dev = backend.device()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = quantized_llama.generate(ids.to(dev), max_new_tokens=4, do_sample=False).cpu()
    expected = ids
    with torch.no_grad():
        for _ in range(4):
            logits = quantized_llama(input_ids=expected.to(dev)).logits.cpu()
            expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, expected)
