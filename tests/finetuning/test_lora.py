"""LoRA the way Hugging Face users write it, `peft.get_peft_model(model, LoraConfig(...))`, on a
model AutoXLA loaded (issue 45: the xla runtime; the decoder stack unrolled, and scanned with the
adapters stacked with their layers).

Against transformers + peft on the CPU, the same adapters: 20 AdamW steps on fixed batches give
the same losses under fsdp and 2d, unrolled and scanned; only the adapters are trainable, get
gradients and optimizer state; the base weights are bit-identical afterwards; after the first
steps no step compiles a program; a scanned stack runs as its loop. A scanned model whose
adapters were not stacked refuses to run, naming the call that stacks them. The adapters merged
and saved (``merge_and_save``) load in plain transformers and in from_pretrained with the logits
of the unmerged model; the adapter saved and loaded onto a fresh model (``load_adapter``) gives
them too.
"""
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.modeling.scan import stack_of
from AutoXLA.state import state_of
from AutoXLA.training import load_adapter, merge_and_save, save_adapter, shard_adapters

from ..helpers import seed_lora_adapters
from ..lora_reference import TARGETS, base_weights, config

STEPS, LR = 20, 1e-3
# fp32 on both sides: the losses differ by summation order (sharded matmuls, reductions over
# devices), ~1e-7 of a loss near 7.4; AdamW's normalised updates carry that into later steps
# without amplifying it much over 20 steps at this learning rate. A lost adapter gradient, a
# base weight that moved or an optimizer state applied twice moves a loss by > 1e-3 relative.
LOSS_RTOL = 1e-5


def _config(head: bool = False):
    return config(TARGETS + ["lm_head"] * head)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (8, 16), generator=g) for _ in range(2)]


def _adapters(model) -> dict:
    """name (from the decoder layers down, per layer even when stacked; the head's whole) ->
    the adapter."""
    return {n.split("layers.", 1)[-1]: t for n, t in model.state_dict().items() if "lora_" in n}


def _train(model, device, compiles=None) -> tuple[list[float], torch.optim.Optimizer]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        ids = _batches()[step % 2].to(device)
        before = backend.compile_count() if compiles is not None else 0
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        if compiles is not None:
            backend.sync()
            compiles.append(backend.compile_count() - before)
        losses.append(float(loss.detach().cpu()))
    return losses, opt


@pytest.fixture(scope="module")
def references(checkpoints):
    """Without and with the lm_head wrapped too."""
    out = {}
    for head in (False, True):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(
            checkpoints["llama"], dtype=torch.float32), _config(head))
        seed_lora_adapters(model)
        model.train()
        losses, _ = _train(model, torch.device("cpu"))
        out[head] = dict(losses=losses, adapters=sorted(_adapters(model)),
                         trainable=sum(p.numel() for p in model.parameters() if p.requires_grad))
    return out


# the scanned case wraps the lm_head too: its adapters sit outside the stack, placed like the
# head's weight
@pytest.mark.parametrize("strategy,scanned,head", [("fsdp", False, False), ("2d", False, False),
                                                   ("2d", True, True)])
def test_lora_steps_give_transformers_and_peft_losses(strategy, scanned, head, checkpoints,
                                                      references, xla_devices):
    reference = references[head]
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32,
                                                    sharding_strategy=strategy,
                                                    scan_layers=scanned)
    base = base_weights(model)
    model = get_peft_model(model, _config(head))
    seed_lora_adapters(model)
    if strategy == "2d":   # placed as planned (the loop does this); fsdp: left as peft made them
        _check_placements(model, shard_adapters(model))
    model.train()
    compiles = []
    losses, opt = _train(model, backend.device(), compiles)

    assert all(abs(g - w) <= LOSS_RTOL * abs(w) for g, w in zip(losses, reference["losses"])), \
        (losses, reference["losses"])
    assert losses[-1] < losses[0] - 0.1                 # the adapters do learn
    if scanned:                                         # one traced layer ran every layer
        assert model.get_base_model().model.layers.last_mode == "scanned"
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(_adapters(model)) == reference["adapters"]
    assert set(trainable) == {n for n in trainable if "lora_" in n}
    assert sum(p.numel() for p in trainable.values()) == reference["trainable"]
    assert all((p.grad is not None) == (n in trainable) for n, p in model.named_parameters())
    assert len(opt.state) == len(trainable)             # optimizer state for the adapters only
    after = base_weights(model)
    assert set(after) == set(base)
    assert all(torch.equal(after[n], w) for n, w in base.items())
    # the first steps compile (forward and backward, then the optimizer's first update, which
    # creates its state); every later step reuses those programs
    assert sum(compiles[2:]) == 0, compiles


def _check_placements(model, planned):
    """Each adapter's sharding on the devices is the one torch_xla gives a fresh tensor of its
    planned spec (stacked: of ``[layers, *shape]`` with the layer axis unsplit), and the model's
    plan records the adapters."""
    mesh = state_of(model.get_base_model()).mesh
    assert model.autoxla_plan.adapters == planned and planned.rank == 8
    stack = stack_of(model)
    if stack is not None:
        stacked = stack.stacked_tensors()
        adapters = {f"model.layers.{i}.{n}".replace(".default", ""): (t, t.shape[0])
                    for n, t in stacked.items() if "lora_" in n for i in stack.scanned_layers}
    else:
        adapters = {}
    held = {id(t) for t, _ in adapters.values()}
    adapters.update({n.removeprefix("base_model.model.").replace(".default", ""): (p, None)
                     for n, p in model.named_parameters() if "lora_" in n and id(p) not in held})
    assert set(adapters) == {t.name for t in planned.tensors}
    split = 0
    for t in planned.tensors:
        tensor, layers = adapters[t.name]
        shape, spec = (t.shape, t.spec) if layers is None else ((layers, *t.shape),
                                                                (None, *t.spec))
        fresh = torch.zeros(shape).to(backend.device())
        backend.mark_sharding(fresh, mesh, spec)
        backend.sync()
        assert backend.sharding_spec(tensor) == backend.sharding_spec(fresh), t.name
        split += t.shard_shape != t.shape
    assert split == len(planned.tensors)   # 2d: every A and B is split over fsdp or model


def test_a_scanned_stack_runs_only_with_its_adapters_stacked(checkpoints, xla_devices):
    # Before shard_adapters each layer holds its own adapters, which the loop's one traced layer
    # cannot take: refused by name rather than run with the first layer's adapters everywhere.
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32,
                                                    sharding_strategy="fsdp")
    model = get_peft_model(model, _config())
    ids = _batches()[0][:2].to(backend.device())
    with pytest.raises(RuntimeError, match=r"shard_adapters\(model\)"):
        model(input_ids=ids)
    shard_adapters(model)
    assert model(input_ids=ids).logits.shape == (2, 16, model.config.vocab_size)
    # LoRA on some layers only cannot be one traced layer: named, with the fix
    other = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32,
                                                    sharding_strategy="fsdp")
    other = get_peft_model(other, LoraConfig(r=8, target_modules=TARGETS, layers_to_transform=[1],
                                             layers_pattern="layers"))
    with pytest.raises(ValueError, match="layers_to_transform"):
        shard_adapters(other)


@pytest.mark.parametrize("scanned", [False, True])
def test_merged_checkpoint_loads_in_transformers_and_from_pretrained(scanned, checkpoints,
                                                                    tmp_path, xla_devices):
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32,
                                                    sharding_strategy="fsdp", scan_layers=scanned)
    model = get_peft_model(model, _config())
    seed_lora_adapters(model)                     # B non-zero: the merge changes every weight
    if scanned:                                   # stacked: merged all layers at once
        shard_adapters(model)
    ids = _batches()[0][:2]
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids.to(backend.device())).logits.cpu()
    # the adapter saved and loaded onto a fresh model (load_adapter: placed, stacked when
    # scanned) gives the same logits: the same fp32 values and programs, summation order only
    save_adapter(model, tmp_path / "adapter")
    fresh = lambda: AutoXLAModelForCausalLM.from_pretrained(  # noqa: E731
        checkpoints["llama"], dtype=torch.float32, sharding_strategy="fsdp", scan_layers=scanned)
    loaded = load_adapter(fresh(), tmp_path / "adapter").eval()
    assert not any(p.requires_grad for p in loaded.parameters())
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids.to(backend.device())).logits.cpu(),
                                   want, rtol=1e-4, atol=1e-4)
    if not scanned:                               # a file without one of the adapters: named
        from safetensors.torch import load_file, save_file
        path = tmp_path / "adapter" / "adapter_model.safetensors"
        tensors = load_file(path)
        gone = sorted(tensors)[0]
        save_file({k: v for k, v in tensors.items() if k != gone}, path)
        with pytest.raises(ValueError, match=rf"adapter_model.safetensors has no tensor {gone}"):
            load_adapter(fresh(), tmp_path / "adapter")
    merged = merge_and_save(model, tmp_path / "merged")
    assert not any("lora_" in n for n in merged.state_dict())
    if scanned:                                   # the stack lost its adapters, kept its loop
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        with torch.no_grad():
            torch.testing.assert_close(merged(input_ids=ids.to(backend.device())).logits.cpu(),
                                       want, rtol=1e-4, atol=1e-4)
        assert stack_of(merged).last_mode == "scanned"
    # fp32, W + B A merged on the device vs the adapters applied beside W: summation order only
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    again = AutoXLAModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                    sharding_strategy="2d", scan_layers=False)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids.to(backend.device())).logits.cpu(), want,
                                   rtol=1e-4, atol=1e-4)
