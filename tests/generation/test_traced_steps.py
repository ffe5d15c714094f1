"""The prefill and decode steps traced once (generation/steps.py): the model's Python runs once
per bucket, weights changed in place are seen, and a forward that reads the device is refused
and run traced every step, with the same tokens.

References are plain transformers' generate on the CPU in fp32 (tests/conftest.py).
"""
import warnings

import pytest
import torch

from AutoXLA import backend
from AutoXLA.generation import GenerationOptions
from AutoXLA.modeling import AutoXLAModelForCausalLM
from tests.helpers import generate_on_device as _generate

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _prompts():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
                        [0, 0, 0, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    return ids, (ids != 0).long()



@pytest.fixture()
def llama(checkpoints, xla_devices):
    """A model of its own: these tests change its weights and hooks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"],
                                                       sharding_strategy="fsdp")


def _count_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_the_model_python_runs_once_per_bucket(llama, reference_models):
    ids, mask = _prompts()
    calls = _count_forwards(llama)
    got = _generate(llama, ids, mask, max_new_tokens=40, **GREEDY)
    # One trace of the prefill and one of the decode step, for 40 tokens.
    assert len(calls) == 2 and llama.autoxla_last_generate.traced == "once"
    assert torch.equal(got, reference_models("llama").generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=40, **GREEDY))
    # The same buckets again (another prompt, another length): no Python forward, no program.
    before = backend.compile_count()
    _generate(llama, ids[:, 2:], mask[:, 2:], max_new_tokens=30, **GREEDY)
    assert len(calls) == 2 and backend.compile_count() == before


def test_weights_changed_in_place_are_seen(llama, reference_models):
    """The traced programs take the weights as inputs: an update in place (as an optimizer step
    makes) changes the next generate's tokens as it changes transformers'."""
    from AutoXLA.saving import unwrap

    ids, mask = _prompts()
    first = _generate(llama, ids, mask, max_new_tokens=16, **GREEDY)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in llama.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator).to(p.device))
    got = _generate(llama, ids, mask, max_new_tokens=16, **GREEDY)
    # The reference: transformers with the changed weights, read back from the devices.
    reference = reference_models("llama")
    reference = type(reference)(reference.config).eval()
    reference.load_state_dict({k: v.cpu() for k, v in unwrap(llama).state_dict().items()})
    assert not torch.equal(got, first)
    assert torch.equal(got, reference.generate(input_ids=ids, attention_mask=mask,
                                               max_new_tokens=16, **GREEDY))


def test_a_forward_that_reads_the_device_runs_traced_every_step(llama, reference_models):
    """A hook that branches on a device value would be frozen into a traced program: the trace
    refuses it, and the steps run as before, with the same tokens and bounded programs."""
    ids, mask = _prompts()
    seen = []
    llama.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(bool(kwargs["input_ids"].sum() > 0)),
        with_kwargs=True)
    expected = reference_models("llama").generate(input_ids=ids, attention_mask=mask,
                                                  max_new_tokens=24, **GREEDY)
    assert torch.equal(_generate(llama, ids, mask, max_new_tokens=24, **GREEDY), expected)
    traced = llama.autoxla_last_generate.traced
    assert traced.startswith("every step") and "read a device value" in traced, traced
    assert len(seen) == 24 + 2          # every step ran the Python (and the refused traces)
    # Bounded: the call after the refused traces compiles its prefill once more (the refused
    # trace changed the first call's graph), then nothing.
    _generate(llama, ids, mask, max_new_tokens=24, **GREEDY)
    before = backend.compile_count()
    _generate(llama, ids, mask, max_new_tokens=24, **GREEDY)
    assert backend.compile_count() == before


def test_tracing_every_step_on_request_gives_the_same_tokens(llama, reference_models):
    ids, mask = _prompts()
    llama.autoxla_generation = GenerationOptions(trace_steps_once=False)
    got = _generate(llama, ids, mask, max_new_tokens=24, **GREEDY)
    assert llama.autoxla_last_generate.traced == "every step (trace_steps_once=False)"
    assert torch.equal(got, reference_models("llama").generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=24, **GREEDY))
    with pytest.raises(ValueError, match="trace_steps_once must be True or False"):
        GenerationOptions(trace_steps_once="yes")
