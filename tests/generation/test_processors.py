"""transformers' logits processors in AutoXLA's generate: min_new_tokens, repetition_penalty,
num_return_sequences and stop_strings, against transformers' own generate on the CPU (its loop,
its processors, its StopStringCriteria), on a padded batch sharded 2d over 8 devices."""
import warnings

import pytest
import torch

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from tests.generation.test_generate import GREEDY, prompts
from tests.helpers import generate_on_device as _generate


@pytest.fixture(scope="module")
def llama(checkpoints, xla_devices):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"],
                                                       sharding_strategy="2d")


def test_repetition_penalty_equals_transformers(llama, reference_models):
    ids, mask = prompts()
    reference = reference_models("llama")
    plain = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, **GREEDY)
    for penalty in (0.6, 1.8):          # below 1 favours the prompt's tokens, above avoids them
        args = dict(GREEDY, max_new_tokens=24, repetition_penalty=penalty)
        expected = reference.generate(input_ids=ids, attention_mask=mask, **args)
        assert not torch.equal(expected, plain)            # the penalty matters here
        assert torch.equal(_generate(llama, ids, mask, **args), expected), penalty
    # another penalty value is device data: nothing compiled
    before = backend.compile_count()
    _generate(llama, ids, mask, **dict(GREEDY, max_new_tokens=24, repetition_penalty=1.3))
    assert backend.compile_count() == before


def test_min_new_tokens_holds_eos_back_like_transformers(llama, reference_models):
    ids, mask = prompts()
    reference = reference_models("llama")
    free = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, **GREEDY)
    eos = int(free[0, 12 + 1])          # row 0's 2nd new token: it would stop there
    args = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=eos,
                min_new_tokens=6)
    expected = reference.generate(input_ids=ids, attention_mask=mask, **args)
    got = _generate(llama, ids, mask, **args)
    assert torch.equal(got, expected)
    assert not (got[0, 12:12 + 6] == eos).any()


def test_num_return_sequences_sample_n_rows_per_prompt(llama):
    ids, mask = prompts()
    args = dict(do_sample=True, temperature=1.5, top_k=0, seed=5, max_new_tokens=12,
                pad_token_id=0, eos_token_id=None)
    out = _generate(llama, ids, mask, num_return_sequences=3, **args)
    assert out.shape == (9, 24)
    assert torch.equal(out[::3, :12], ids) and torch.equal(out[1::3, :12], ids)
    # each prompt's three rows are three draws; the same seed gives the same nine rows
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])
    assert torch.equal(_generate(llama, ids, mask, num_return_sequences=3, **args), out)
    with pytest.raises(ValueError, match="num_return_sequences"):  # transformers' own check
        _generate(llama, ids, mask, num_return_sequences=2, **dict(GREEDY, max_new_tokens=4))


def test_stop_strings_end_like_transformers(chat_checkpoint, xla_devices):
    from transformers import AutoModelForCausalLM

    path, tokenizer = chat_checkpoint
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="fsdp")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = tokenizer(["The capital of France is", "Once upon a time there"],
                      return_tensors="pt", padding=True, padding_side="left")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    args = dict(max_new_tokens=20, do_sample=False, pad_token_id=2, eos_token_id=2)
    free = reference.generate(input_ids=ids, attention_mask=mask, **args)
    text = tokenizer.decode(free[0, ids.shape[1]:])
    stop = text[len(text) // 3:len(text) // 3 + 4]      # ends row 0 about a third of the way
    assert stop.strip()
    expected = reference.generate(input_ids=ids, attention_mask=mask, stop_strings=[stop],
                                  tokenizer=tokenizer, **args)
    got = model.generate(input_ids=ids, attention_mask=mask, stop_strings=[stop],
                         tokenizer=tokenizer, **args)
    assert torch.equal(got, expected)
    assert stop in tokenizer.decode(got[0, ids.shape[1]:])
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(input_ids=ids, attention_mask=mask, stop_strings=[stop], **args)
