"""Both attention kernels, the real Pallas code interpreted, inside every decoder family on 8
devices, against transformers' eager attention on the CPU.

Each test asserts that the kernel ran (a spy on attention/tpu.py's run_* counts the calls; a
scanned stack traces its loop body once, so once per layer of a group) or, where a kernel cannot
take a layer, that AutoXLA said so. Tolerances: the interpreted kernels compute in fp32 with an
online softmax, like the portable path, so the model tests keep tests/helpers.py's 1e-4 and
tests/attention/test_models.py's gradient bound (2e-5 of the largest entry).
"""
import logging

import pytest
import torch

from AutoXLA import backend
from AutoXLA.attention import KERNELS, tpu
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.testing.tiny import available_families
from tests.conftest import reference_loader
from tests.helpers import (assert_close, assert_greedy_like, eager_loss_and_q_proj_grad,
                           embeds_and_q_proj_grads, left_padded_training_batch)

FAMILIES = available_families()
GRAD_FRACTION_OF_MAX, GRAD_RTOL = 2e-5, 1e-4
RUN = {"xla_flash_attention": "run_flash", "splash_attention": "run_splash"}
GREEDY = {"llama", "gemma2"}


def _load(path, kernel, strategy="fsdp", **kwargs):
    return AutoXLAModelForCausalLM.from_pretrained(
        path, sharding_strategy=strategy, attn_implementation=kernel, **kwargs)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """family -> a 4-layer tiny checkpoint: two periods of Gemma 2's sliding/full pattern, so
    every family's stack is scanned (the session's 2-layer Gemma 2 is one period, unrolled)."""
    from AutoXLA.testing.tiny import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("four-layers")
    return {f: save_tiny_checkpoint(f, root / f, seed=i, num_hidden_layers=4)
            for i, f in enumerate(FAMILIES)}


@pytest.fixture
def kernel_calls(monkeypatch):
    """kernel name -> how many times AutoXLA called it (and the batch each call carried)."""
    calls = {k: [] for k in KERNELS}
    for kernel, name in RUN.items():
        real = getattr(tpu, name)

        def spy(arguments, real=real, kernel=kernel):
            calls[kernel].append(arguments["q"].shape[0])
            return real(arguments)
        monkeypatch.setattr(tpu, name, spy)
    return calls


def _takes_every_layer(family, kernel, config) -> bool:
    """flash has no window and no soft-cap: Gemma 2 (soft-cap everywhere) and Mistral (a window
    everywhere) run none of their layers through it."""
    windowed = getattr(config, "sliding_window", None) is not None
    softcap = getattr(config, "attn_logit_softcapping", None) is not None
    return kernel == "splash_attention" or not (windowed or softcap)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_forward_gradients_and_greedy_in_the_scanned_stack(
        family, kernel, four_layers, batch, kernel_calls, xla_devices, caplog, monkeypatch):
    # The seed's Quick Start combination: fsdp on 8 devices, the default scanned stack, and a
    # batch of 2 rows that does not fill data*fsdp = 8 (padded for the call, sliced after).
    from AutoXLA.attention import hf

    monkeypatch.setattr(hf, "_WARNED", set())   # each test sees its own once-per-process warnings
    ids, mask = batch
    reference = reference_loader(four_layers)(family)
    with caplog.at_level(logging.WARNING, logger="AutoXLA"):
        model = _load(four_layers[family], kernel)
        assert model.autoxla_plan.stack.scanned
        dev = backend.device()
        with torch.no_grad():
            got = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()
    expected = reference(input_ids=ids, attention_mask=mask).logits.detach()
    valid = mask.bool()
    assert_close(got[valid], expected[valid], what=f"{family}/{kernel} logits")
    if _takes_every_layer(family, kernel, model.config):
        # One traced call per layer of the scanned group, each with the batch padded to 8.
        assert kernel_calls[kernel] and set(kernel_calls[kernel]) == {8}
    else:   # the portable path's gradients and tokens are tests/attention's
        assert not kernel_calls[kernel]
        assert "xla_flash_attention has no sliding window or logit soft-cap" in caplog.text
        return

    _assert_grads_like(reference, model, ids, mask, f"{family}/{kernel}")

    # Greedy tokens: the kernel runs in the prefill; decoding over the static cache takes the
    # portable path (one query against a cache is not a shape either kernel takes). The prefill
    # calls the kernel as the forward above does, so one plain family and the windowed,
    # soft-capped one are enough (each generate compiles two more programs).
    if family not in GREEDY:
        return
    assert_greedy_like(reference, model, ids, mask, f"{family}/{kernel}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("strategy,scan", [("2d", True), ("3d", True), ("fsdp", False)])
def test_other_strategies_and_the_unrolled_stack(strategy, scan, kernel, checkpoints,
                                                 reference_models, batch, kernel_calls,
                                                 xla_devices):
    ids, mask = batch
    model = _load(checkpoints["llama"], kernel, strategy=strategy, scan_layers=scan)
    assert model.autoxla_plan.stack.scanned is scan
    dev = backend.device()
    with torch.no_grad():
        got = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()
    expected = reference_models("llama")(input_ids=ids, attention_mask=mask).logits.detach()
    valid = mask.bool()
    assert_close(got[valid], expected[valid], what=f"llama/{kernel}/{strategy} logits")
    layers = model.config.num_hidden_layers
    assert len(kernel_calls[kernel]) == (model.autoxla_plan.stack.group if scan else layers)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_batches_that_do_and_do_not_fill_the_mesh(rows, kernel, checkpoints, reference_models,
                                                  kernel_calls, xla_devices):
    # Batch 1 under fsdp crashed torch_xla's flash wrapper before padding (its output came back
    # with 8 rows: "mm(): cannot matrix-multiply tensors f32[128,2048] and f32[256,256]").
    # 20 tokens, one row per seed, no padding mask.
    ids = torch.randint(3, 200, (rows, 20), generator=torch.Generator().manual_seed(rows))
    model = _load(checkpoints["llama"], kernel)
    with torch.no_grad():
        got = model(input_ids=ids.to(backend.device())).logits.cpu()
    expected = reference_models("llama")(input_ids=ids).logits.detach()
    assert_close(got, expected, what=f"llama/{kernel} logits, {rows} row(s)")
    assert kernel_calls[kernel] and set(kernel_calls[kernel]) == {8}


@pytest.mark.parametrize("kernel", KERNELS)
def test_sequences_that_do_not_divide_the_blocks(kernel, checkpoints, reference_models,
                                                 kernel_calls, xla_devices):
    # 640 tokens on 512-token blocks: torch_xla's flash wrapper pads the keys inside the call;
    # for splash, which does not pad, AutoXLA appends positions up to 1024 and slices them off.
    ids = torch.randint(3, 200, (1, 640), generator=torch.Generator().manual_seed(1))
    expected = reference_models("llama")(input_ids=ids).logits.detach()
    model = _load(checkpoints["llama"], kernel, attention_config={"sa_block_q": 512,
                                                                  "sa_block_kv": 512})
    with torch.no_grad():
        got = model(input_ids=ids.to(backend.device())).logits.cpu()
    assert_close(got, expected, what=f"{kernel} logits, 640 tokens")
    assert kernel_calls[kernel]


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_sinks_run_eager_attention_and_say_so(kernel, tmp_path, kernel_calls,
                                                        xla_devices, caplog):
    # gpt-oss adds a learned logit per head to every softmax (s_aux): no kernel has it, and
    # before this both names silently dropped it (on any device).
    from transformers import AutoModelForCausalLM

    from AutoXLA.testing.architectures import save_checkpoint

    # Sinks that matter (random ones near 0 barely do), saved in the checkpoint AutoXLA loads.
    source = save_checkpoint("gpt-oss", tmp_path / "gpt-oss")
    eager = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = torch.randint(3, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        without = eager(input_ids=ids).logits
        for layer in eager.model.layers:
            layer.self_attn.sinks.fill_(3.0)
        expected = eager(input_ids=ids).logits
    assert (expected - without).abs().max() > 1e-2
    eager.save_pretrained(tmp_path / "sinks")
    with caplog.at_level(logging.WARNING, logger="AutoXLA"):
        # 2d, as before; fsdp at this batch of 2, which once aborted XLA's partitioner (a
        # scatter in the experts' routing, docs/models.md), runs in test_architectures.py.
        model = _load(tmp_path / "sinks", kernel, strategy="2d")
        with torch.no_grad():
            got = model(input_ids=ids.to(backend.device())).logits.cpu()
    assert "attention sinks (gpt-oss)" in caplog.text
    assert not kernel_calls[kernel]
    assert_close(got, expected, what=f"gpt-oss/{kernel} logits with sinks")


# Issue 43: grouped-query heads that do not divide the model axis. Both kernels cut q, k and v
# by whole heads over the spec's heads axes, so the plan decides (sharding/attention_heads.py):
# on model=2 (2d, 3d) the 6 query heads split and the 3 kv heads are repeated 2x; on model=8
# (mp) the 6 query heads do not divide and stay whole; fsdp and dp have no model axis. Before,
# splash under 2d raised in its shard_map ("maps array axis 1 (of size 3) to mesh axis 'model'
# (of size 2)"). The issue's model: Llama, 6 heads / 3 kv heads, head_dim 16, scanned.
GQA_STRATEGIES = {"fsdp": ((), 1), "dp": ((), 1), "mp": ((), 1), "2d": (("model",), 2),
                  "3d": (("model",), 2)}


@pytest.fixture(scope="module")
def gqa_six_three(tmp_path_factory):
    """(checkpoint, transformers' eager model on the CPU): the issue's 6 / 3-head Llama."""
    from transformers import AutoModelForCausalLM

    from AutoXLA.testing.tiny import save_tiny_checkpoint

    path = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("gqa-6-3"), seed=43,
                                hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
                                head_dim=16)
    return path, AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _rows(rows: int, length: int = 20):
    """``rows`` sequences, the last left-padded by 3 when there are several (segment ids)."""
    ids = torch.randint(3, 200, (rows, length), generator=torch.Generator().manual_seed(rows))
    mask = torch.ones_like(ids)
    if rows > 1:
        ids[-1, :3], mask[-1, :3] = 0, 0
    return ids, mask


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("strategy", list(GQA_STRATEGIES))
def test_gqa_heads_that_do_not_divide_the_model_axis(strategy, kernel, gqa_six_three,
                                                     kernel_calls, xla_devices):
    path, reference = gqa_six_three
    model = _load(path, kernel, strategy=strategy)
    plan = model.autoxla_plan
    assert plan.stack.scanned
    dev = backend.device()
    shards = tpu.batch_shards((("data", "fsdp"),), model.autoxla_mesh)
    for rows in (1, 2, 3, 4):
        ids, mask = _rows(rows)
        kernel_calls[kernel].clear()
        with torch.no_grad():
            got = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()
        expected = reference(input_ids=ids, attention_mask=mask).logits
        valid = mask.bool()
        assert_close(got[valid], expected[valid], what=f"{kernel}/{strategy}, {rows} row(s)")
        # One traced call per layer of the scanned group, the batch padded to whole shards.
        assert kernel_calls[kernel] == [-(-rows // shards) * shards] * plan.stack.group
    heads = plan.layer_attention.heads
    axes, repeat = GQA_STRATEGIES[strategy]
    # Flash has no grouped-query attention: its kv heads always become the query heads (2x).
    assert (heads.axes, heads.kv_repeat) == (axes, 2 if kernel == "xla_flash_attention" else repeat)
    if strategy not in ("2d", "mp"):
        return
    # Generation: the prefill runs the kernel, decoding the portable path over the static cache.
    ids, mask = _rows(3)
    assert_greedy_like(reference, model, ids, mask, f"{kernel}/{strategy}")


def test_kv_heads_repeated_fewer_times_than_the_group(tmp_path, kernel_calls, xla_devices):
    # 12 query / 3 kv heads on model=2 (2d): groups of 4, and repeating each kv head 2x (not 4x)
    # already divides the axis (Llama-3-70B's 64 / 8 on 16 is the same case). Each device then
    # holds 6 query heads and 3 repeated kv heads, 2 query heads per repeated head: a wrong
    # order (kv heads tiled instead of interleaved) pairs query heads with other groups' keys.
    # Logits, gradients (the repeat's backward sums the copies) and greedy tokens.
    from transformers import AutoModelForCausalLM

    from AutoXLA.testing.tiny import save_tiny_checkpoint

    path = save_tiny_checkpoint("llama", tmp_path / "gqa-12-3", seed=12, hidden_size=48,
                                num_attention_heads=12, num_key_value_heads=3, head_dim=8)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    model = _load(path, "splash_attention", strategy="2d")
    ids, mask = _rows(4)
    _assert_logits_like(reference, model, ids, mask, "12/3 heads on model=2 logits")
    assert kernel_calls["splash_attention"]
    heads = model.autoxla_plan.layer_attention.heads
    assert (heads.axes, heads.kv_repeat) == (("model",), 2)

    _assert_grads_like(reference, model, ids, mask, "12/3 heads on model=2")

    assert_greedy_like(reference, model, ids, mask, "12/3 heads on model=2")


def _assert_grads_like(reference, model, ids, mask, what):
    """d/d embeddings (at the real positions) and d/d layer 0's q_proj of a random weighting of
    the logits equal transformers' (this file's gradient tolerances)."""
    weights = torch.randn(*ids.shape, reference.config.vocab_size,
                          generator=torch.Generator().manual_seed(0)) * mask[..., None]
    expected = embeds_and_q_proj_grads(reference, ids, mask, weights, "cpu")
    got = embeds_and_q_proj_grads(model, ids, mask, weights, backend.device())
    valid = mask.bool()
    for part, g, e in (("d/d embeds", got[0][valid], expected[0][valid]),
                       ("d/d q_proj", got[1], expected[1])):
        assert_close(g, e, GRAD_FRACTION_OF_MAX * e.abs().max().item(), GRAD_RTOL,
                     f"{what} {part}")


def _assert_logits_like(reference, model, ids, mask, what):
    """The model's logits equal transformers' at the real (unpadded) positions."""
    with torch.no_grad():
        got = model(input_ids=ids.to(backend.device()), attention_mask=mask.to(backend.device()))
    expected = reference(input_ids=ids, attention_mask=mask).logits.detach()
    valid = mask.bool()
    assert_close(got.logits.cpu()[valid], expected[valid], what=what)


def test_gemma2_fixture_under_2d(four_layers, kernel_calls, xla_devices):
    # The project's own 6 / 3-head Gemma 2 (soft-cap, sliding and global layers), whose kernel
    # tests ran under fsdp only, under 2d: its 3 kv heads repeated 2x on model=2.
    ids, mask = _rows(2)
    reference = reference_loader(four_layers)("gemma2")
    model = _load(four_layers["gemma2"], "splash_attention", strategy="2d")
    _assert_logits_like(reference, model, ids, mask, "gemma2/splash/2d logits")
    assert len(kernel_calls["splash_attention"]) == model.autoxla_plan.stack.group
    assert model.autoxla_plan.layer_attention.heads.kv_repeat == 2
    assert_greedy_like(reference, model, ids, mask, "gemma2/splash/2d")


@pytest.mark.parametrize("kernel", KERNELS)
def test_left_padded_training_loss_and_gradients_equal_eager(kernel, checkpoints,
                                                             reference_models, kernel_calls,
                                                             xla_devices):
    # Issue 43 with the real kernels: they take padding as segment ids, so a left pad attends to
    # the pads before it, where transformers' eager mask leaves it no key (v's mean over every
    # key). The last pad predicts the first real token, so the loss reads it even with the pads'
    # labels masked. AutoXLA puts eager's rows there after the call (attention/hf.py). Loss
    # tolerance: tests/modeling/test_training.py's; gradients: this file's.
    ids, mask, labels = left_padded_training_batch()
    expected, want = eager_loss_and_q_proj_grad(reference_models("llama"), ids, mask, labels)
    model = _load(checkpoints["llama"], kernel, strategy="2d")
    model.train()
    dev = backend.device()
    loss = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev)).loss
    loss.backward()
    got = model.model.layers.stacked_tensors()["self_attn.q_proj.weight"].grad[0].cpu()
    assert kernel_calls[kernel]
    assert abs(loss.item() - expected.item()) <= 1e-4, (loss.item(), expected.item())
    assert torch.isfinite(got).all()
    assert_close(got, want, GRAD_FRACTION_OF_MAX * want.abs().max().item(), GRAD_RTOL,
                 f"{kernel}: d loss / d layer 0 q_proj")
