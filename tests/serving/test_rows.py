"""Per-row sampling (generation/rows.py) on the CPU, against transformers' own logits processors
and warpers applied to each row alone, and OpenAI's penalty formula in float64."""
import torch

from AutoXLA.generation import rows
from AutoXLA.generation.sampling import uniform, uniform_per_row

VOCAB = 300


def settings(**per_row):
    """RowSettings of 3 rows: defaults, overridden by lists of 3 values (or of any one
    length, every field given)."""
    n = len(next(iter(per_row.values()))) if per_row else 3
    values = dict(greedy=[True] * n, temperature=[1.0] * n, top_k=[0] * n, top_p=[1.0] * n,
                  seed=[0] * n, min_tokens=[0] * n, repetition=[1.0] * n, presence=[0.0] * n,
                  frequency=[0.0] * n, stop_ids=[[2, -1]] * n)
    values.update(per_row)
    dtypes = dict(greedy=torch.bool, top_k=torch.int64, seed=torch.int64,
                  min_tokens=torch.int64, stop_ids=torch.int64)
    return rows.RowSettings(**{k: torch.tensor(v, dtype=dtypes.get(k, torch.float32))
                               for k, v in values.items()})


def history():
    """Each row's input ids (prompt and output) and which of them were generated."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 12), generator=g)
    generated = torch.zeros_like(ids, dtype=torch.bool)
    generated[:, 7:] = True                 # 7 prompt tokens, 5 new ones
    seen = torch.zeros(3, VOCAB, dtype=torch.bool).scatter(1, ids, True)
    counts = torch.zeros(3, VOCAB, dtype=torch.int32).scatter_add(
        1, ids, generated.to(torch.int32))
    return ids, seen, counts


def logits_of(seed=0):
    return torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_equals_transformers_per_row():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    ids, seen, counts = history()
    logits = logits_of()
    penalties = [1.0, 1.3, 0.8]
    got = rows.process(logits, settings(repetition=penalties), seen, counts,
                       torch.tensor([5, 5, 5]))
    for r, p in enumerate(penalties):
        expected = RepetitionPenaltyLogitsProcessor(p)(ids[r:r + 1], logits[r:r + 1].clone())
        torch.testing.assert_close(got[r], expected[0], rtol=0, atol=0)   # same float32 ops


def test_min_tokens_equals_transformers_min_new_tokens():
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    ids, seen, counts = history()
    logits = logits_of(2)
    stop = [[2, 7], [2, 7], [2, 7]]
    got = rows.process(logits, settings(min_tokens=[0, 5, 6], stop_ids=stop), seen, counts,
                       torch.tensor([5, 5, 5]))
    for r, minimum in enumerate([0, 5, 6]):
        proc = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=7,
                                                 min_new_tokens=minimum, eos_token_id=[2, 7])
        expected = proc(ids[r:r + 1], logits[r:r + 1].clone())
        assert torch.equal(got[r], expected[0])
    assert torch.isinf(got[2, [2, 7]]).all() and not torch.isinf(got[1]).any()


def test_presence_and_frequency_penalties_are_openais_formula():
    ids, seen, counts = history()
    logits = logits_of(3)
    presence, frequency = [0.0, 0.5, -1.0], [0.0, 0.7, 0.25]
    got = rows.process(logits, settings(presence=presence, frequency=frequency), seen, counts,
                       torch.tensor([5, 5, 5]))
    c = counts.double()
    expected = (logits.double() - torch.tensor(frequency).double()[:, None] * c
                - torch.tensor(presence).double()[:, None] * (c > 0).double())
    # float32 against float64: one rounding of |logit| <= ~15 plus a product, < 1e-5
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_warpers_equal_transformers_per_row():
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = logits_of(4)
    temps, ks, ps = [0.7, 1.0, 1.3], [0, 5, 40], [0.9, 1.0, 0.5]
    got = rows.warp(logits, settings(greedy=[False] * 3, temperature=temps, top_k=ks, top_p=ps))
    for r in range(3):
        expected = TemperatureLogitsWarper(temps[r])(None, logits[r:r + 1].clone())
        if ks[r]:
            expected = TopKLogitsWarper(ks[r])(None, expected)
        if ps[r] < 1:
            expected = TopPLogitsWarper(ps[r])(None, expected)
        assert torch.equal(torch.isinf(got[r]), torch.isinf(expected[0])), r
        kept = ~torch.isinf(expected[0])
        torch.testing.assert_close(got[r][kept], expected[0][kept])


def test_each_row_draws_what_it_would_draw_alone():
    seeds, steps = torch.tensor([7, 7, 123]), torch.tensor([0, 3, 9])
    shared = uniform_per_row(seeds, steps, 500)
    for r in range(3):
        assert torch.equal(shared[r], uniform(seeds[r], steps[r], 1, 500)[0])


def test_greedy_rows_ignore_warpers_and_sampling_rows_follow_the_seed():
    logits = logits_of(5)
    ids, seen, counts = history()
    none = torch.zeros_like(seen)
    zero = torch.zeros_like(counts)
    s = settings(greedy=[True, False, False], temperature=[0.1, 1.0, 1.0], top_k=[1, 0, 0],
                 seed=[0, 11, 11])
    picked = rows.choose(logits, s, none, zero, torch.tensor([0, 4, 4]))
    assert int(picked[0]) == int(logits[0].argmax())
    assert int(picked[1]) == int(torch.argmax(
        logits[1] - torch.log(-torch.log(uniform(torch.tensor(11), torch.tensor(4), 1, VOCAB)[0]))))
    # rows 1 and 2 differ only in their logits: the same seed and step draw the same noise
    again = rows.choose(logits, s, none, zero, torch.tensor([0, 4, 4]))
    assert torch.equal(picked, again)


def test_warpers_equal_transformers_on_many_random_rows():
    """64 rows of random settings, some logits tied, k beyond the vocabulary, p near 0 and 1:
    the kept set is transformers' exactly (top-p's sums differ only in rounding order)."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    g = torch.Generator().manual_seed(7)
    n = 64
    logits = torch.randn(n, VOCAB, generator=g) * torch.rand(n, 1, generator=g) * 6
    logits[::5, :40] = logits[::5, :1]                     # ties at the top
    temps = (torch.rand(n, generator=g) * 1.8 + 0.2).tolist()
    ks = torch.randint(0, 2 * VOCAB, (n,), generator=g).tolist()
    ks[::3] = [0] * len(ks[::3])
    ps = torch.rand(n, generator=g).clamp(min=0.01).tolist()
    ps[::4] = [1.0] * len(ps[::4])
    s = settings(greedy=[False] * n, temperature=temps, top_k=ks, top_p=ps, seed=[0] * n,
                 min_tokens=[0] * n, repetition=[1.0] * n, presence=[0.0] * n,
                 frequency=[0.0] * n, stop_ids=[[2, -1]] * n)
    got = rows.warp(logits, s)
    for r in range(n):
        expected = TemperatureLogitsWarper(temps[r])(None, logits[r:r + 1].clone())
        if ks[r]:
            expected = TopKLogitsWarper(ks[r])(None, expected)
        if ps[r] < 1:
            expected = TopPLogitsWarper(ps[r])(None, expected)
        assert torch.equal(torch.isinf(got[r]), torch.isinf(expected[0])), (r, temps[r], ks[r],
                                                                            ps[r])


def test_tiny_temperatures_choose_the_greedy_tokens():
    """Issue 43 item 9, in the sampling math itself (the server's rows and generate's sampler):
    logits / 1e-38 or / 1e-46 (0 in float32) are inf and NaN, and their argmax was garbage;
    below GREEDY_BELOW a temperature picks the argmax, as temperature 0 does."""
    from AutoXLA.generation.sampling import GREEDY_BELOW, Sampler, next_tokens

    logits = logits_of(9)
    ids, seen, counts = history()
    tiny = [1e-38, 1e-46, GREEDY_BELOW / 2]
    s = settings(greedy=[False] * 3, temperature=tiny, top_k=[0, 40, 0], top_p=[1.0, 1.0, 0.9],
                 seed=[3, 4, 5])
    picked = rows.choose(logits, s, torch.zeros_like(seen), torch.zeros_like(counts),
                         torch.tensor([1, 2, 3]))
    assert picked.tolist() == logits.argmax(-1).tolist()
    for temperature in tiny:
        sampler = Sampler(True, 40, torch.tensor(temperature, dtype=torch.float32),
                          torch.tensor(0.9), torch.tensor(5))
        assert next_tokens(logits, sampler, torch.tensor(2)).tolist() == \
            logits.argmax(-1).tolist()
