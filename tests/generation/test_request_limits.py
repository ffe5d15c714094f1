"""What a generate call may ask (issue 27): several threads at once, requests bounded before
anything is allocated, ids and masks that mean what transformers makes of them. The reference is
plain transformers' generate on the CPU (tests/conftest.py)."""
import threading
import time

import pytest
import torch
from transformers import GenerationConfig

from AutoXLA import backend
from AutoXLA.generation import GenerationOptions
from AutoXLA.modeling import AutoXLAModelForCausalLM

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module")
def llama(checkpoints, xla_devices):
    return AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], sharding_strategy="fsdp")


def _prompt(seed: int, length: int = 9) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def test_generate_from_four_threads_equals_one_thread(llama):
    """4 threads x 5 calls on one model (a web app's request threads): each call is served
    whole, one at a time (backend.device_owner), and returns what the same call returns alone."""
    calls = [(t, c) for t in range(4) for c in range(5)]
    alone = {tc: llama.generate(input_ids=_prompt(10 * tc[0] + tc[1]), max_new_tokens=6, **GREEDY)
             for tc in calls}
    compiled = backend.compile_count()
    got, errors = {}, []

    def worker(t):
        try:
            for c in range(5):
                got[t, c] = llama.generate(input_ids=_prompt(10 * t + c), max_new_tokens=6,
                                           **GREEDY)
        except BaseException as e:       # noqa: BLE001 - reported below, with the thread
            errors.append((t, e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)
    assert sorted(got) == calls and time.perf_counter() - t0 < 300
    for tc in calls:
        assert torch.equal(got[tc], alone[tc]), tc
    assert backend.compile_count() == compiled          # the same two programs, shared


@pytest.mark.parametrize("length, new, match", [
    (9, 10**8, r"9 tokens plus max_new_tokens=100000000 is 100000009 positions, more than the "
               r"model's max_position_embeddings \(512\)"),
    (600, 4, r"a prompt of 600 tokens plus max_new_tokens=4 is 604 positions"),
])
def test_requests_past_the_models_positions_are_refused_before_allocating(llama, length, new,
                                                                          match):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        llama.generate(input_ids=_prompt(0, length), max_new_tokens=new, **GREEDY)
    assert time.perf_counter() - t0 < 5                 # refused, not attempted


def test_a_server_ceiling_and_an_oversized_bucket(llama):
    llama.autoxla_generation = GenerationOptions(max_positions=32)
    try:
        with pytest.raises(ValueError, match=r"more than GenerationOptions\(max_positions=32\)"):
            llama.generate(input_ids=_prompt(0), max_new_tokens=24, **GREEDY)
        # A prompt bucket of 10**9 slots: a cache of 2**30, 512 GiB of K and V per device here
        # (batch 1 is replicated over fsdp), refused against the free memory before allocating.
        llama.autoxla_generation = GenerationOptions(prompt_buckets=(10**9,))
        with pytest.raises(ValueError, match=r"KV cache \(batch bucket 1, cache length "
                           r"1073741824\) needs 524,288.0 MiB per device, more than 90% of"):
            llama.generate(input_ids=_prompt(0), max_new_tokens=4, **GREEDY)
        # Set as a dict after loading, as docs/generation.md says it may be: checked and used.
        llama.autoxla_generation = {"max_cache_len": 96}
        llama.generate(input_ids=_prompt(0), max_new_tokens=4, **GREEDY)
        assert llama.autoxla_last_generate.cache_length == 96
        llama.autoxla_generation = {"max_cache": 96}
        with pytest.raises(TypeError, match=r"unknown key\(s\) \['max_cache'\]"):
            llama.generate(input_ids=_prompt(0), max_new_tokens=4, **GREEDY)
    finally:
        llama.autoxla_generation = GenerationOptions()


@pytest.mark.parametrize("ids, mask, match", [
    (torch.tensor([[5, 256, 7]]), None, r"token id 256 at \(0, 1\), outside the model's "
                                        r"vocabulary 0\.\.255"),
    (torch.tensor([[5, -1, 7]]), None, r"token id -1 at \(0, 1\)"),
    (torch.tensor([[5.0, 6.7]]), None, "must hold integer token ids, got dtype torch.float32"),
    (torch.tensor([[True, False]]), None, "got dtype torch.bool"),
    (torch.zeros((1, 0), dtype=torch.long), None, r"shape \(1, 0\): an empty prompt"),
    (torch.tensor([[5, 6, 7]]), torch.tensor([[0.5, 1.0, 1.0]]), "attention_mask holds 0.5"),
    (torch.tensor([[5, 6], [7, 8]]), torch.tensor([[1, 1], [0, 0]]),
     r"row\(s\) \[1\] of attention_mask mask every token"),
    (torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1]]), "attention_mask has shape"),
])
def test_bad_ids_and_masks_are_refused(llama, ids, mask, match):
    with pytest.raises(ValueError, match=match):
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **GREEDY)


def test_without_pad_or_eos_a_real_token_0_is_not_masked(llama, reference_models):
    """Neither EOS nor pad: transformers masks nothing (its pad default needs an EOS), so a 0 in
    the prompt is a real token. The old default pad of 0 masked it."""
    config = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None,
                              pad_token_id=None, bos_token_id=None)
    ids = torch.tensor([[0, 5, 0, 9, 0, 17]])
    expected = reference_models("llama").generate(input_ids=ids, generation_config=config)
    got = llama.generate(input_ids=ids, generation_config=config)
    assert torch.equal(got, expected)
