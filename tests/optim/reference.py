"""Float64 implementations of the published update rules, written from the papers' algorithms.

Each class takes the initial parameters and is fed one list of gradients per step; it keeps its
own float64 copy of the parameters and states. Besides the parameters, each records per element
the largest magnitude the parameter had (``max_param``, initial value included) and the largest
change one step made (``max_delta``): float32's rounding errors are relative to these, so the
tests scale their tolerance by them.

- Lion: Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2 (with
  decoupled weight decay).
- CAME: Luo et al. 2023, "CAME: Confidence-guided Adaptive Memory Efficient Optimization",
  Algorithm 1, with the paper's sums (``(...) 1_m``, ``1_n^T (...)``; libraries use means, which
  give the same ``v`` and ``S``).
- SM3: Anil et al. 2019, "Memory-Efficient Adaptive Optimization", SM3-II, with the cover of a
  tensor by its slices along each dimension (the paper's choice for tensors, Section 4).

Where the papers leave a case open or the optimizers add an option, the choice is stated at that
spot: CAME's vectors and higher-rank tensors, decoupled weight decay in CAME, SM3's ``eps``,
momentum and ``beta``.
"""
from __future__ import annotations

import math

import torch


def _f64(tensors) -> list[torch.Tensor]:
    return [t.detach().to("cpu", torch.float64).clone() for t in tensors]


class _Reference:
    def __init__(self, params):
        self.params = _f64(params)
        self.max_param = [p.abs() for p in self.params]
        self.max_delta = [torch.zeros_like(p) for p in self.params]
        self.steps = 0

    def step(self, grads) -> None:
        grads = _f64(grads)
        assert len(grads) == len(self.params), (len(grads), len(self.params))
        for i, (theta, g) in enumerate(zip(self.params, grads)):
            assert g.shape == theta.shape, (i, g.shape, theta.shape)
            new = self._update(i, theta, g)
            self.max_delta[i] = torch.maximum(self.max_delta[i], (new - theta).abs())
            self.max_param[i] = torch.maximum(self.max_param[i], new.abs())
            self.params[i] = new
        self.steps += 1

    def _update(self, i: int, theta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Lion(_Reference):
    """Algorithm 2: c = b1 m + (1 - b1) g;  theta -= lr (sign(c) + wd theta);
    m = b2 m + (1 - b2) g.

    sign() is discontinuous at 0, so a float32 run may flip an element whose c is within its
    rounding of 0. ``tie_margin`` records, per element, the smallest |c| / G over the steps, where
    G is the largest |g| seen so far at that element (G bounds |m| and |g|, so float32's error in
    c is a few ulps of G per step). Elements with a margin below ``near_tie`` can flip (by 2 lr
    each time, the momentum does not depend on the sign); the tests exclude them and check they
    are rare. Exact zeros (g and m both 0) are not ties: sign is 0 in
    any precision.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params)
        self.lr, (self.b1, self.b2), self.wd = lr, betas, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]
        self.g_max = [torch.zeros_like(p) for p in self.params]
        self.tie_margin = [torch.full_like(p, math.inf) for p in self.params]

    def _update(self, i, theta, g):
        m = self.m[i]
        c = self.b1 * m + (1 - self.b1) * g
        self.g_max[i] = torch.maximum(self.g_max[i], g.abs())
        margin = torch.where(self.g_max[i] > 0, c.abs() / self.g_max[i].clamp(min=1e-300),
                             torch.full_like(c, math.inf))
        self.tie_margin[i] = torch.minimum(self.tie_margin[i], margin)
        self.m[i] = self.b2 * m + (1 - self.b2) * g
        return theta - self.lr * (torch.sign(c) + self.wd * theta)

    def near_ties(self, i: int, near_tie: float) -> torch.Tensor:
        return self.tie_margin[i] < near_tie


class CAME(_Reference):
    """Algorithm 1, for a matrix g (n x m):

        r = b2 r + (1 - b2) (g^2 + eps1) 1_m          c = b2 c + (1 - b2) 1_n^T (g^2 + eps1)
        v = r c / (1_n^T r)                           u = g / sqrt(v)
        u^ = u / max(1, RMS(u) / d)                   m = b1 m + (1 - b1) u^
        U = (u^ - m)^2
        R = b3 R + (1 - b3) (U + eps2) 1_m            C = b3 C + (1 - b3) 1_n^T (U + eps2)
        S = R C / (1_n^T R)                           theta -= lr m / sqrt(S)

    Cases the paper leaves open, decided as its authors' code (github.com/yangluo7/CAME) does:
    a vector keeps a full second moment v = b2 v + (1 - b2)(g^2 + eps1) and steps by m (no
    confidence factor); a tensor of rank > 2 is a stack of matrices over its last two
    dimensions, each factored on its own, with RMS(u) over the whole tensor. Weight decay (not in
    Algorithm 1) is decoupled: theta -= lr wd theta, from the parameter before the step.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.999, 0.9999), eps=(1e-30, 1e-16),
                 clip_threshold: float = 1.0, weight_decay: float = 0.0):
        super().__init__(params)
        self.lr, (self.b1, self.b2, self.b3), (self.eps1, self.eps2) = lr, betas, eps
        self.d, self.wd = clip_threshold, weight_decay
        self.state = [self._zeros(p) for p in self.params]

    @staticmethod
    def _zeros(p):
        state = {"m": torch.zeros_like(p)}
        if p.dim() >= 2:
            rows, cols = p.shape[:-1], p.shape[:-2] + p.shape[-1:]
            state.update(r=torch.zeros(rows, dtype=p.dtype), c=torch.zeros(cols, dtype=p.dtype),
                         R=torch.zeros(rows, dtype=p.dtype), C=torch.zeros(cols, dtype=p.dtype))
        else:
            state["v"] = torch.zeros_like(p)
        return state

    @staticmethod
    def _factored(row, col):
        """row c / (1^T row), for [..., n] rows and [..., m] columns: the [..., n, m] estimate."""
        return row[..., :, None] * col[..., None, :] / row.sum(-1)[..., None, None]

    def _update(self, i, theta, g):
        s = self.state[i]
        g2 = g * g + self.eps1
        if g.dim() >= 2:
            s["r"] = self.b2 * s["r"] + (1 - self.b2) * g2.sum(-1)
            s["c"] = self.b2 * s["c"] + (1 - self.b2) * g2.sum(-2)
            v = self._factored(s["r"], s["c"])
        else:
            s["v"] = self.b2 * s["v"] + (1 - self.b2) * g2
            v = s["v"]
        u = g / v.sqrt()
        rms = u.pow(2).mean().sqrt()
        u_hat = u / max(1.0, rms.item() / self.d)
        s["m"] = self.b1 * s["m"] + (1 - self.b1) * u_hat
        if g.dim() >= 2:
            U = (u_hat - s["m"]) ** 2 + self.eps2
            s["R"] = self.b3 * s["R"] + (1 - self.b3) * U.sum(-1)
            s["C"] = self.b3 * s["C"] + (1 - self.b3) * U.sum(-2)
            direction = s["m"] / self._factored(s["R"], s["C"]).sqrt()
        else:
            direction = s["m"]
        return theta - self.lr * direction - self.lr * self.wd * theta


class SM3(_Reference):
    """SM3-II. For a rank-k tensor the cover is its slices: the set (i, r) holds the elements
    whose index along dimension i is r, with one accumulator mu_i[r]. Each step:

        nu(j)     = min_i mu_i[j_i] + g(j)^2
        theta(j) -= lr g(j) / sqrt(nu(j))
        mu_i[r]   = max of nu(j) over the elements j with j_i = r   (mu' starts at 0 each step)

    A vector's cover is its elements (Adagrad), a scalar is its own set. Additions the optimizers
    make and the paper's algorithm does not have, written as they document them:
    - ``eps`` inside the root, sqrt(nu + eps) (the paper defines 0/0 as 0 instead);
    - ``momentum``: the step uses m = momentum m + (1 - momentum) u, u the preconditioned
      gradient above (the paper's experiments add momentum; its algorithm box does not);
    - ``beta`` > 0 (PyTorch-SM3's exponential variant): nu = beta min_i mu_i + (1 - beta) g^2
      and mu_i = max(mu_i, max over the slice of nu). beta = 0 is SM3-II.
    """

    def __init__(self, params, lr: float, momentum: float = 0.0, beta: float = 0.0,
                 eps: float = 0.0):
        super().__init__(params)
        self.lr, self.momentum, self.beta, self.eps = lr, momentum, beta, eps
        self.mu = [[torch.zeros(n, dtype=p.dtype) for n in p.shape] if p.dim() else
                   [torch.zeros((), dtype=p.dtype)] for p in self.params]
        self.m = [torch.zeros_like(p) for p in self.params]

    @staticmethod
    def _along(acc, dim, rank):
        """mu_i as a tensor that broadcasts along every dimension but ``dim``."""
        return acc.reshape([-1 if d == dim else 1 for d in range(rank)])

    def _update(self, i, theta, g):
        mu, rank = self.mu[i], g.dim()
        if rank == 0:
            smallest = mu[0]
        else:
            smallest = self._along(mu[0], 0, rank).expand(g.shape)
            for d in range(1, rank):
                smallest = torch.minimum(smallest, self._along(mu[d], d, rank))
        if self.beta == 0:
            nu = smallest + g * g                                        # SM3-II
        else:
            nu = self.beta * smallest + (1 - self.beta) * g * g          # the exponential variant
        if rank == 0:
            mu[0] = nu if self.beta == 0 else torch.maximum(mu[0], nu)
        for d in range(rank):
            others = [o for o in range(rank) if o != d]
            slice_max = nu.amax(dim=others) if others else nu
            mu[d] = slice_max if self.beta == 0 else torch.maximum(mu[d], slice_max)
        denom = (nu + self.eps).sqrt()
        u = torch.where(denom > 0, g / denom.clamp(min=1e-300), torch.zeros_like(g))  # 0/0 := 0
        if self.momentum:
            self.m[i] = self.momentum * self.m[i] + (1 - self.momentum) * u
            u = self.m[i]
        return theta - self.lr * u
