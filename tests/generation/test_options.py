"""Buckets, generate keywords and the KV-cache plan: pure Python, no devices."""
import pytest
import torch

from AutoXLA.generation import GenerationOptions
from AutoXLA.generation.request import build_request
from AutoXLA.sharding.kv_cache import kv_cache_for
from AutoXLA.sharding.mesh import MeshShape


def test_power_of_two_buckets():
    o = GenerationOptions()
    assert [o.batch_bucket(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [o.prompt_bucket(n) for n in (1, 12, 16, 17, 100)] == [16, 16, 16, 32, 128]
    # The cache holds the padded prompt and every new token, rounded up.
    assert o.cache_length(16, 8) == 64 and o.cache_length(16, 64) == 128
    assert o.cache_length(16, 256) == 512


def test_explicit_buckets_and_fixed_cache():
    o = GenerationOptions(prompt_buckets=(8, 24), max_cache_len=100)
    assert o.prompt_bucket(9) == 24 and o.cache_length(24, 50) == 100
    with pytest.raises(ValueError, match="larger than the largest prompt bucket 24"):
        o.prompt_bucket(25)
    with pytest.raises(ValueError, match="more than max_cache_len=100"):
        o.cache_length(24, 77)


def test_shapes_padded_for_compiled_steps_exact_for_eager_ones():
    o = GenerationOptions(prompt_buckets=(8, 24), max_cache_len=100)
    assert o.shapes(3, 9, 50) == (4, 24, 100)                  # the xla runtime: buckets
    # the dtensor runtime (nothing compiled): the request's own shapes, its slots exactly; the
    # prompt buckets do not bound it, max_cache_len still does
    assert o.shapes(3, 30, 50, padded=False) == (3, 30, 80)
    with pytest.raises(ValueError, match="more than max_cache_len=100"):
        o.shapes(3, 30, 71, padded=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_buckets=(8, 4)), "ascending"),
    (dict(batch_buckets=()), "ascending"),
    (dict(stop_check_every=0), "positive int"),
    (dict(max_cache_len=1), "max_cache_len"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationOptions(**kwargs)
    with pytest.raises(TypeError, match="unknown key"):
        GenerationOptions.from_any({"buckets": 3})


def test_kv_cache_plan_specs_and_bytes():
    # 2 kv heads split over model=2, batch 8 over fsdp=4: 1/8 of the cache per device.
    kv = kv_cache_for((2, 2, 16), MeshShape(1, 4, 2), "float32", batch=8, length=64)
    assert kv.spec == (("fsdp"), "model", None, None) and kv.reason == ""
    assert kv.total_bytes == 2 * 2 * 8 * 2 * 64 * 16 * 4
    assert kv.bytes_per_device(MeshShape(1, 4, 2)) == kv.total_bytes // 8
    # 3 kv heads on model=2 and batch 2 on fsdp=4: replicated, and the plan says why.
    kv = kv_cache_for((2, 3, 16), MeshShape(1, 4, 2), "bfloat16", batch=2, length=64)
    assert kv.spec == (None, None, None, None)
    assert "batch 2 does not divide data*fsdp = 4" in kv.reason
    assert "3 kv heads do not divide model axis 2" in kv.reason
    assert "MiB per device" in kv.describe(MeshShape(1, 4, 2))


@pytest.fixture(scope="module")
def cpu_llama(reference_models):
    return reference_models("llama")


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_beams=2), "num_beams=2 is not supported"),
    (dict(no_repeat_ngram_size=3), "no_repeat_ngram_size=3 is not supported"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a number > 0"),
    (dict(num_return_sequences=2), "num_return_sequences"),
    (dict(min_new_tokens=-1), "min_new_tokens must be a non-negative int"),
    (dict(stop_strings=["x"]), "stop_strings need the model's tokenizer"),
    (dict(logits_processor=[object()]), "logits_processor"),
    (dict(use_cache=False), "use_cache=False"),
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
    (dict(do_sample=True, top_p=1.5), "top_p must be in"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(bogus_option=1), "bogus_option"),
])
def test_unsupported_generate_keywords_are_named(kwargs, match, cpu_llama):
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises((ValueError, TypeError), match=match):
        build_request(cpu_llama, 5, **kwargs)


def test_request_follows_transformers_defaults(cpu_llama):
    r = build_request(cpu_llama, 5, max_new_tokens=4, do_sample=True, seed=3)
    assert (r.temperature, r.top_k, r.top_p) == (1.0, 50, 1.0)      # transformers' defaults
    assert r.eos_token_ids == (2,) and r.pad_token_id == 0            # from the tiny config
    r = build_request(cpu_llama, 5, max_length=9)                     # max_length counts the prompt
    assert r.max_new_tokens == 4 and not r.do_sample and r.top_k is None
    torch.manual_seed(0)
    a = build_request(cpu_llama, 5, max_new_tokens=4, do_sample=True).seed
    torch.manual_seed(0)
    assert build_request(cpu_llama, 5, max_new_tokens=4, do_sample=True).seed == a
