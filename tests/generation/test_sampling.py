"""The sampling math on the CPU, against transformers' own logits warpers and the softmax."""
import math

import pytest
import torch

from AutoXLA.generation.sampling import filter_logits, gumbel, uniform


def test_noise_is_a_pure_function_of_seed_step_row_column():
    seed, step = torch.tensor(7), torch.tensor(3)
    a = uniform(seed, step, 4, 1000)
    assert torch.equal(a, uniform(seed, step, 4, 1000))
    assert torch.equal(a[:2, :500], uniform(seed, step, 2, 500))      # independent of the shape
    assert not torch.equal(a, uniform(torch.tensor(8), step, 4, 1000))
    assert not torch.equal(a, uniform(seed, torch.tensor(4), 4, 1000))
    assert 0 < a.min() and a.max() < 1


def test_noise_is_uniform():
    u = uniform(torch.tensor(123), torch.tensor(0), 64, 4096).flatten().double()
    n = u.numel()
    # Mean and variance of U(0,1) are 1/2 and 1/12; with n = 262144 draws their standard errors
    # are 5.6e-4 and 5.0e-4, so 6 standard errors (4e-3) fail only for a broken hash.
    assert abs(u.mean() - 0.5) < 4e-3 and abs(u.var() - 1 / 12) < 4e-3
    counts = torch.histc(u, bins=16, min=0, max=1)
    chi2 = float(((counts - n / 16) ** 2 / (n / 16)).sum())
    assert chi2 < 50, chi2      # 15 degrees of freedom: P(chi2 > 50) ~ 1e-5


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 20, 0.5), (1.0, 300, 0.95)])
def test_filters_equal_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 256, generator=g) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p is not None:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = filter_logits(logits, torch.tensor(temperature), top_k,
                        None if top_p is None else torch.tensor(top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    kept = ~torch.isinf(expected)
    torch.testing.assert_close(got[kept], expected[kept])


def test_gumbel_max_draws_from_the_softmax():
    # 20000 rows draw from one 6-token distribution; each row has its own noise.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 20000
    draws = torch.argmax(logits + gumbel(torch.tensor(5), torch.tensor(0), rows, 6), dim=-1)
    p = torch.softmax(logits.double(), -1)
    counts = torch.bincount(draws, minlength=6).double()
    chi2 = float(((counts - rows * p) ** 2 / (rows * p)).sum())
    assert chi2 < 25, (chi2, (counts / rows).tolist(), p.tolist())  # 5 dof: P(chi2 > 25) ~ 1e-4
    assert math.isclose(float(counts[0] / rows), float(p[0]), abs_tol=0.02)
