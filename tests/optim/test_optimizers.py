"""AutoXLA.optim: Lion, CAME and SM3 against float64 implementations of their papers' update rules
(tests/optim/reference.py), on the CPU and on 8 devices under fsdp + FSDPv2; their states sharded
like their parameters; no device-to-host transfer and no new program per step; a training run with
each lowers the loss; XLAOptimizerWrapper."""
import re
import warnings

import pytest
import torch

from AutoXLA import backend, optim
from AutoXLA.modeling import AutoXLAModelForCausalLM

from . import reference

EPS32 = 2.0 ** -24          # float32's unit roundoff

# Tolerance per element after n steps: n * K * EPS32 * (max |theta| + largest single-step change),
# the maxima over the run (reference.max_param, max_delta). Each step rounds theta a few times in
# float32 (the weight-decay product, the add: ~2 ulps of |theta|), and adds a step whose float32
# direction has a relative error of a few ulps per op on it; the hyperparameters themselves are
# float32 on XLA (lr, betas: 0.5 ulp each). K counts those ulps per step, generously:
# - Lion: the direction sign(c) is exact away from ties (ties are excluded, see reference.Lion);
#   2 roundings of theta, 1 - lr * wd and lr rounded -> K = 4.
# - SM3: square, sum with the accumulator, sqrt, divide, momentum average -> K = 8.
# - CAME: row/column means over <= 128 positive terms (pairwise/vectorised sums: <= log2(128) = 7
#   ulps), the factored product, rsqrt, the RMS clip, two moving averages, the residual and its
#   means, a second factored rsqrt -> K = 32.
# Observed: at most ~2 ulps per step for all three (CPU and XLA). Mis-set hyperparameters in the
# reference give far more (tried by hand, CPU case): a weight decay of 0.11 instead of 0.1 for
# Lion ~1300 ulps, a CAME clip threshold of 1.1 instead of 1 ~2100, beta2 of 0.99 for 0.999
# ~10^4, SM3's momentum 0.89 for 0.9 ~10^5.
ULPS_PER_STEP = {"lion": 4, "sm3": 8, "came": 32}

# The original AutoXLA's keywords (their values where they differ from pytorch_optimizer's
# defaults are the point of the mapping), and the same rule in the reference.
CASES = {
    "lion": (lambda ps: optim.Lion(ps, lr=1e-3, weight_decay=0.1),
             lambda ps: reference.Lion(ps, lr=1e-3, betas=(0.95, 0.98), weight_decay=0.1)),
    "came": (lambda ps: optim.CAME(ps, lr=1e-3, weight_decay=0.1),
             lambda ps: reference.CAME(ps, lr=1e-3, betas=(0.9, 0.999, 0.9999),
                                       eps=(1e-30, 1e-16), clip_threshold=1.0, weight_decay=0.1)),
    "sm3": (lambda ps: optim.SM3(ps, lr=0.1, momentum=0.9),
            lambda ps: reference.SM3(ps, lr=0.1, momentum=0.9, eps=1e-8)),
}
# On the CPU only: pytorch_optimizer's per-parameter loop (foreach=False; the batched path runs by
# default for Lion and CAME, on XLA too), SM3 without momentum and its exponential variant.
VARIANTS = {
    "lion-loop": (lambda ps: optim.Lion(ps, lr=1e-3, weight_decay=0.1, foreach=False),
                  CASES["lion"][1]),
    "came-loop": (lambda ps: optim.CAME(ps, lr=1e-3, weight_decay=0.1, foreach=False),
                  CASES["came"][1]),
    "sm3-sum": (lambda ps: optim.SM3(ps, lr=0.1),
                lambda ps: reference.SM3(ps, lr=0.1, eps=1e-8)),
    "sm3-beta": (lambda ps: optim.SM3(ps, lr=0.1, momentum=0.5, beta=0.9),
                 lambda ps: reference.SM3(ps, lr=0.1, momentum=0.5, beta=0.9, eps=1e-8)),
}
MAX_TIE_FRACTION = 0.01


def assert_matches_reference(name, actual, ref, names=None):
    """Every parameter equals the reference's within the tolerance above."""
    kind = name.split("-")[0]
    for i, p in enumerate(actual):
        what = names[i] if names else f"parameter {i} {tuple(p.shape)}"
        got, want = p.detach().cpu().double(), ref.params[i]
        diff = (got - want).abs()
        scale = ref.max_param[i] + ref.max_delta[i]
        bound = ref.steps * ULPS_PER_STEP[kind] * EPS32 * scale
        checked = torch.ones_like(diff, dtype=torch.bool)
        if kind == "lion":
            # float32's c is within (steps + 2) ulps of G of float64's (reference.Lion): 16x that.
            ties = ref.near_ties(i, 16 * (ref.steps + 2) * EPS32)
            assert ties.double().mean() <= MAX_TIE_FRACTION, f"{what}: {int(ties.sum())} near-ties"
            checked = ~ties
        bad = (diff > bound) & checked
        assert not bad.any(), (
            f"{name} {what}: {int(bad.sum())} elements beyond tolerance after {ref.steps} steps; "
            f"max |diff| {diff[checked].max():.3e}, max |diff|/(ulp * scale) "
            f"{(diff[checked] / (EPS32 * scale[checked])).max():.1f}")


# ---------------------------------------------------------------- (a) CPU, float32 vs float64

SHAPES = [(7,), (5, 6), (3, 4, 5)]


@pytest.mark.parametrize("name", [*CASES, *VARIANTS])
def test_cpu_float32_equals_float64_reference(name):
    make, make_ref = {**CASES, **VARIANTS}[name]
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    initial = reference._f64(params)
    ref, opt = make_ref(params), make(params)
    for _ in range(8):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        opt.step()
        ref.step(grads)
    assert_matches_reference(name, params, ref)
    # Not vacuous: every parameter moved by far more than the tolerance.
    moved = [(p.detach().double() - p0).abs().max().item() for p, p0 in zip(params, initial)]
    assert min(moved) > 1e-3, moved


def test_sm3_keeps_a_scalar_as_its_own_set():
    p = torch.nn.Parameter(torch.tensor(0.5))
    ref, opt = reference.SM3([p], lr=0.1, eps=1e-8), optim.SM3([p], lr=0.1)
    for grad in (0.3, -0.2, 0.7, 0.0, -1.1):
        p.grad = torch.tensor(grad)
        opt.step()
        ref.step([torch.tensor(grad)])
    assert_matches_reference("sm3", [p], ref)


# ---------------------------------------------------------------- keywords of the original

def test_original_defaults_and_keywords():
    p = [torch.nn.Parameter(torch.zeros(2, 3))]
    assert optim.Lion(p).defaults["betas"] == (0.95, 0.98)
    assert optim.SM3(p).defaults["eps"] == 1e-8
    came = optim.CAME(p, 1e-3, (1e-29, 1e-15), 0.5, (0.8, 0.9, 0.99), 0.01)   # positional, as before
    assert (came.defaults["eps1"], came.defaults["eps2"]) == (1e-29, 1e-15)
    assert came.clip_threshold == 0.5 and came.defaults["betas"] == (0.8, 0.9, 0.99)
    assert came.defaults["weight_decay"] == 0.01 and came.defaults["weight_decouple"]
    lion = optim.Lion(p, 1e-3, (0.9, 0.99), None, 0.1)                       # scaling in 4th place
    assert lion.defaults["weight_decay"] == 0.1
    from AutoXLA.optim.came import CAME
    from AutoXLA.optim.lion import Lion
    from AutoXLA.optim.optim_wrapper import XLAOptimizerWrapper
    from AutoXLA.optim.sm3 import SM3
    assert (CAME, Lion, SM3, XLAOptimizerWrapper) == (optim.CAME, optim.Lion, optim.SM3,
                                                      optim.XLAOptimizerWrapper)


@pytest.mark.parametrize("make, keyword", [
    (lambda p: optim.Lion(p, scaling=10.0), "scaling"),
    (lambda p: optim.Lion(p, nesterov_momentum=0.1), "nesterov_momentum"),
    (lambda p: optim.SM3(p, scale=True), "scale"),
])
def test_keywords_without_effect_warn_once(make, keyword):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make([torch.nn.Parameter(torch.zeros(2))])
    assert len(caught) == 1 and f"({keyword}=...)" in str(caught[0].message), caught
    assert "no effect here" in str(caught[0].message)
    assert caught[0].filename == __file__            # points at the caller's line


def test_no_warning_for_defaults():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = [torch.nn.Parameter(torch.zeros(2))]
        optim.Lion(p), optim.SM3(p), optim.CAME(p), optim.Lion(p, nesterov_momentum=0)


@pytest.mark.parametrize("kwargs, words", [
    (dict(eps=1e-30), "pair (eps1, eps2)"),
    (dict(betas=(0.9, 0.999)), "three values"),
    (dict(lr=None), "needs a learning rate"),
])
def test_came_bad_keywords(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        optim.CAME([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)


def test_came_refuses_library_eps_names():
    with pytest.raises(TypeError, match=re.escape("eps=(eps1, eps2)")):
        optim.CAME([torch.nn.Parameter(torch.zeros(2, 2))], eps1=1e-30)


# ---------------------------------------------------------------- the wrapper

def test_wrapper_delegates():
    p = torch.nn.Parameter(torch.ones(3))
    inner = optim.Lion([p], lr=0.1)
    opt = optim.XLAOptimizerWrapper(inner)
    assert opt.param_groups is inner.param_groups and opt.defaults is inner.defaults
    p.grad = torch.ones(3)
    assert opt.step(lambda: 7.0) == 7.0                      # the closure's loss comes back
    assert torch.allclose(p.detach(), torch.full((3,), 0.9))
    saved = opt.state_dict()
    opt.zero_grad()
    assert p.grad is None
    fresh = optim.XLAOptimizerWrapper(optim.Lion([p], lr=0.1))
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.state[p]["exp_avg"], inner.state[p]["exp_avg"])
    with pytest.raises(TypeError, match="wraps a torch optimizer"):
        optim.XLAOptimizerWrapper(object())


# ---------------------------------------------------------------- (b), (c) 8 devices, FSDPv2

COMPARED_STEPS = 4      # steps compared with the reference
TRAINED_STEPS = 8       # further steps, to see the loss fall


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (8, 16), generator=g)
    return ids, ids.clone()


_RUNS = {}


def _executions() -> int:
    """Programs run so far (torch_xla records one when a run finishes, hence the wait)."""
    import torch_xla.debug.metrics as met

    backend.wait_for_transfers()
    return (met.metric_data("ExecuteReplicatedTime") or [0])[0]


def _run(name, checkpoints):
    """One tiny Llama under fsdp + FSDPv2 trained with optimizer ``name`` (once per module).

    Each step syncs after the backward, so that the forward and backward are one program shared
    by all three optimizers (compiled once: the fused step compiles for ~15 s per optimizer on
    this machine) and the counts below see the optimizer's step alone. The reference steps on the
    gradients the devices computed.
    """
    if name in _RUNS:
        return _RUNS[name]
    model = AutoXLAModelForCausalLM.from_pretrained(
        checkpoints["llama"], sharding_strategy="fsdp", use_fsdp_wrap=True)
    model.train()
    dev = backend.device()
    ids, labels = (t.to(dev) for t in _batch())
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    make, make_ref = CASES[name]
    ref = make_ref([p.detach().cpu() for p in params])
    opt = optim.XLAOptimizerWrapper(make(params))
    losses, compiles, transfers, executions = [], [], [], []
    for step in range(COMPARED_STEPS + TRAINED_STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        backend.sync()
        losses.append(loss.detach())
        if step < COMPARED_STEPS:
            ref.step([p.grad.cpu() for p in params])
        before = backend.compile_count(), backend.transfers_from_device(), _executions()
        opt.step()
        executions.append(_executions() - before[2])
        compiles.append(backend.compile_count() - before[0])
        transfers.append(backend.transfers_from_device() - before[1])
        if step == COMPARED_STEPS - 1:
            compared = [p.detach().cpu() for p in params]
    run = dict(names=[n for n, _ in named], params=params, compared=compared, ref=ref,
               optimizer=opt.optimizer, losses=[float(l) for l in torch.stack(losses).cpu()],
               compiles=compiles, transfers=transfers, executions=executions)
    _RUNS[name] = run
    return run


@pytest.mark.parametrize("name", list(CASES))
def test_fsdpv2_steps_equal_float64_reference(name, checkpoints, xla_devices):
    # The reference steps on the very gradients the devices computed, so the comparison measures
    # the optimizer alone; the tolerance is (a)'s (XLA reorders the same float32 sums).
    run = _run(name, checkpoints)
    assert_matches_reference(name, run["compared"], run["ref"], names=run["names"])


@pytest.mark.parametrize("name", list(CASES))
def test_fsdpv2_training_lowers_the_loss(name, checkpoints, xla_devices):
    losses = _run(name, checkpoints)["losses"]
    # 12 steps on one batch of random tokens: memorising it takes the loss (6.9 nats at the
    # start) well down; an optimizer stepping the wrong way or not at all cannot.
    assert losses[-1] < losses[0] - 1.0, losses
    assert all(torch.isfinite(torch.tensor(losses))), losses


@pytest.mark.parametrize("name", list(CASES))
def test_fsdpv2_step_is_one_program_without_host_transfers(name, checkpoints, xla_devices):
    run = _run(name, checkpoints)
    steps = COMPARED_STEPS + TRAINED_STEPS
    # wrapper.step() runs the update as one program and ends the graph there.
    assert run["executions"] == [1] * steps, run["executions"]
    # Nothing inside the step reads the device (no .item() or tensor-valued branch).
    assert run["transfers"] == [0] * steps, run["transfers"]
    # Step 1 compiles the update (states created inside it), step 2 again (states now inputs);
    # no later step compiles.
    assert run["compiles"][0] > 0 and run["compiles"][2:] == [0] * (steps - 2), run["compiles"]


def test_wrapper_step_ends_the_graph(xla_devices):
    # Forward, backward and update traced without a sync in between: wrapper.step() makes them
    # one program per step, and the program does not change from step 3 on.
    dev = backend.device()
    w = torch.nn.Parameter(torch.randn(8, 4).to(dev))
    x = torch.randn(16, 8).to(dev)
    opt = optim.XLAOptimizerWrapper(optim.CAME([w], lr=1e-2))
    runs, compiles = [], []
    for _ in range(4):
        before = _executions(), backend.compile_count()
        opt.zero_grad()
        (x @ w).square().mean().backward()
        opt.step()
        runs.append(_executions() - before[0])
        compiles.append(backend.compile_count() - before[1])
    assert runs == [1, 1, 1, 1] and compiles[2:] == [0, 0], (runs, compiles)


_SPEC = re.compile(r"\{devices=\[([\d,]+)\]([\d,]+)\}")


def _kept_dims(key: str, rank: int) -> tuple[int, ...] | None:
    """The parameter dimensions a state tensor keeps, in order (None: it has the full shape)."""
    if key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_hat", "momentum_buffer"):
        return None
    if key.endswith("_row"):                  # CAME: the mean over the last dimension
        return tuple(range(rank - 1))
    if key.endswith("_col"):                  # CAME: the mean over the second-to-last
        return tuple(range(rank - 2)) + (rank - 1,)
    if key.startswith("accumulator_"):        # SM3: one per dimension, the others size 1
        return (int(key.split("_")[1]),)
    if key == "RMS":                          # CAME's (unused) scalar RMS of the parameter
        return ()
    raise AssertionError(f"unexpected state {key!r}: add it to _kept_dims")


def _expected_spec(param_spec: str, kept, state: torch.Tensor) -> str:
    """The parameter's sharding restricted to the kept dimensions (size-1 dimensions unsplit)."""
    if kept is None or param_spec in ("", "{replicated}"):
        return param_spec or "{replicated}"
    m = _SPEC.fullmatch(param_spec)
    assert m, f"unexpected parameter sharding {param_spec}"
    tiles, devices = [int(t) for t in m.group(1).split(",")], m.group(2)
    assert sum(t > 1 for t in tiles) == 1, f"fsdp shards one dimension, got {param_spec}"
    if state.dim() == len(tiles):             # SM3: same rank, size 1 where not kept
        new = [tiles[d] if d in kept else 1 for d in range(len(tiles))]
    else:
        new = [tiles[d] for d in kept]
    return f"{{devices=[{','.join(map(str, new))}]{devices}}}" if any(t > 1 for t in new) \
        else "{replicated}"


@pytest.mark.parametrize("name", list(CASES))
def test_fsdpv2_states_sharded_like_their_parameters(name, checkpoints, xla_devices):
    run = _run(name, checkpoints)
    opt = run["optimizer"]
    seen = sharded_factored = 0
    for pname, p in zip(run["names"], run["params"]):
        pspec = backend.sharding_spec(p)
        assert pspec.startswith("{devices="), f"{pname} is not sharded: {pspec}"
        for key, value in opt.state[p].items():
            if not isinstance(value, torch.Tensor):
                continue
            kept = _kept_dims(key, p.dim())
            if kept is None:
                assert value.shape == p.shape, (pname, key)
            expected = _expected_spec(pspec, kept, value)
            actual = backend.sharding_spec(value) or "{replicated}"
            assert actual == expected, f"{name} {pname} state {key}: {actual}, expected {expected}"
            seen += 1
            sharded_factored += kept not in (None, ()) and expected != "{replicated}"
    assert seen >= len(run["params"])
    if name != "lion":   # factored states exist, and some are split along a dimension they keep
        assert sharded_factored > 0


def test_stacked_decoder_layers_are_announced(checkpoints, xla_devices):
    # CAME's clipping and SM3's accumulators span a tensor's dimensions: a scanned stack
    # ([layers, ...]) changes what they compute, so the user is told; Lion is element-wise.
    scanned = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"])
    unrolled = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], scan_layers=False)
    for make in (optim.CAME, optim.SM3):
        with pytest.warns(UserWarning, match=r"hold 2 decoder layers each.*scan_layers=False"):
            make(scanned.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            make(unrolled.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optim.Lion(scanned.parameters())
