"""Sharded causal LMs equal plain transformers, for every family and strategy."""
import pytest
import torch

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.testing.tiny import available_families

from ..helpers import assert_close, check_sharding_matches_plan

STRATEGIES = [("fsdp", False), ("fsdp", True), ("dp", False), ("mp", False), ("2d", False),
              ("3d", False)]


@pytest.mark.parametrize("strategy,fsdp_wrap", STRATEGIES, ids=lambda v: str(v))
@pytest.mark.parametrize("family", available_families())
def test_logits_and_sharding_match(family, strategy, fsdp_wrap, checkpoints, reference_models,
                                   batch, xla_devices):
    ids, mask = batch
    model = AutoXLAModelForCausalLM.from_pretrained(
        checkpoints[family], sharding_strategy=strategy, use_fsdp_wrap=fsdp_wrap)
    dev = backend.device()
    with torch.no_grad():
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev))
        expected = reference_models(family)(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert_close(out.logits.cpu()[valid], expected[valid], what=f"{family}/{strategy} logits")
    # 8 rows: a batch every strategy splits over its data and fsdp axes (2 rows are replicated
    # on most meshes, which once hid wrong rows under 3d).
    rows = torch.cat([ids, torch.randint(3, 200, (6, ids.shape[1]),
                                         generator=torch.Generator().manual_seed(1))])
    rows_mask = torch.cat([mask, torch.ones(6, ids.shape[1], dtype=mask.dtype)])
    with torch.no_grad():
        out8 = model(input_ids=rows.to(dev), attention_mask=rows_mask.to(dev)).logits.cpu()
        expected8 = reference_models(family)(input_ids=rows, attention_mask=rows_mask).logits
    assert_close(out8[rows_mask.bool()], expected8[rows_mask.bool()],
                 what=f"{family}/{strategy} logits, batch 8")

    plan = model.autoxla_plan
    # The names users read are views of the one holder (AutoXLA/state.py), wrapper or not.
    inner = model.autoxla_module if fsdp_wrap else model
    assert (model.autoxla.plan, model.autoxla.mesh, model.autoxla.module) == (
        plan, model.autoxla_mesh, inner if fsdp_wrap else None)
    assert inner.autoxla.plan is plan and inner.autoxla.load is inner.autoxla_load is not None
    n = check_sharding_matches_plan(model, plan, model.autoxla_mesh)
    assert n == len(plan.parameters) > 0
    for t in plan.replicated_for_divisibility:
        assert "replicated on" in t.reason and "divide" in t.reason, t


def test_divisibility_reasons_are_listed(checkpoints, xla_devices):
    # Llama has 2 kv heads: on mp (model=8) its k/v projections cannot split by whole heads.
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], sharding_strategy="mp")
    k = model.autoxla_plan["model.layers.0.self_attn.k_proj.weight"]
    assert k.spec == (None, None)
    assert k.reason == "replicated on model: 2 heads do not divide model=8"
    assert "2 heads do not divide model=8" in str(model.autoxla_plan)
    # ... while on 2d (model=2) they split.
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], sharding_strategy="2d")
    assert model.autoxla_plan["model.layers.0.self_attn.k_proj.weight"].spec == ("model", "fsdp")


def test_output_is_sharded_modeloutput(checkpoints, xla_devices):
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], sharding_strategy="fsdp")
    ids = torch.randint(3, 200, (8, 6)).to(backend.device())
    with torch.no_grad():
        out = model(input_ids=ids)
    backend.sync()
    # batch 8 over fsdp=8: one sequence per device.
    assert backend.sharding_spec(out.logits).startswith("{devices=[8,1,1]")
