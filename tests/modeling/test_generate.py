"""Greedy generation on the sharded model gives plain transformers' tokens."""
import pytest
import torch

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.tiny import available_families

NEW_TOKENS = 8


@pytest.mark.parametrize("family", available_families())
def test_greedy_generate_matches_transformers(family, checkpoints, reference_models, batch,
                                              xla_devices):
    ids, mask = batch
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints[family], sharding_strategy="2d")
    args = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = reference_models(family).generate(input_ids=ids, attention_mask=mask, **args)
    dev = backend.device()
    got = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args).cpu()
    assert got.shape == (2, ids.shape[1] + NEW_TOKENS)
    assert torch.equal(got, expected), f"{family}: {got.tolist()} != {expected.tolist()}"
