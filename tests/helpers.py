"""Shared checks for the model tests."""
import functools

import torch

# Logits are compared in fp32 against fp32 transformers on the CPU. The sharded program reorders
# fp32 sums (partial matmuls over fsdp/model shards, then all-reduce): each reordering costs a few
# ulps per accumulation, over reductions of <= 128 terms, 2 layers and ~10 ops each, on logits of
# magnitude <= ~10. 1e-4 absolute + 1e-4 relative covers that with margin (observed ~1e-5), while a
# wrong shard, mask or position changes logits by O(0.1-1).
LOGIT_ATOL = 1e-4
LOGIT_RTOL = 1e-4


def assert_close(actual, expected, atol=LOGIT_ATOL, rtol=LOGIT_RTOL, what="logits"):
    actual, expected = actual.double(), expected.double()
    diff = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert (diff <= bound).all(), (
        f"{what}: max |diff| {diff.max().item():.3e} exceeds atol {atol} + rtol {rtol} "
        f"(max |expected| {expected.abs().max().item():.3e})")


@functools.cache
def reference_sharding_string(shape, spec, mesh_key):
    """The sharding string torch_xla's own mark_sharding gives a fresh tensor of this shape/spec."""
    from AutoXLA import backend

    mesh = _MESHES[mesh_key]
    t = torch.zeros(shape).to(backend.device())
    backend.mark_sharding(t, mesh, spec)
    backend.sync()
    return backend.sharding_spec(t)


_MESHES = {}


def check_sharding_matches_plan(model, plan, mesh):
    """Every parameter's actual sharding is the one the plan states; its shards hold the right data."""
    from AutoXLA import backend
    from torch_xla.distributed.spmd import XLAShardedTensor

    _MESHES[id(mesh)] = mesh
    backend.sync()
    inner = getattr(model, "module", model)
    params = dict(_unwrapped_named_parameters(inner))
    stacked = _stacked_layers(inner)
    checked = 0
    # Parameters, and the quantized weights, scales and zero points (buffers the plan shards).
    for t in [t for t in plan if not t.is_buffer or t.quant]:
        if t.name in stacked:
            checked += _check_stacked_layer(t, *stacked[t.name], mesh)
            continue
        p = params[t.name]
        actual = backend.sharding_spec(p)
        expected = reference_sharding_string(tuple(t.shape), t.spec, id(mesh))
        if all(a is None for a in t.spec):
            assert actual in ("{replicated}", ""), f"{t.name}: planned replicated, is {actual}"
        else:
            assert actual == expected, f"{t.name}: planned {t.spec_str} ({expected}), is {actual}"
        full = p.detach().cpu()
        for shard in XLAShardedTensor(p.detach()).local_shards:
            assert tuple(shard.data.shape) == tuple(t.shard_shape), (
                f"{t.name}: shard shape {tuple(shard.data.shape)} != planned {t.shard_shape}")
            idx = shard.indices if shard.indices is Ellipsis else tuple(shard.indices)
            assert torch.equal(shard.data, full[idx]), f"{t.name}: shard data misplaced"
        checked += 1
    return checked


def _stacked_layers(model):
    """Per-layer plan name -> (the scanned stack's [layers, ...] tensor, layer index)."""
    from AutoXLA.modeling.scan import StackedDecoderLayers

    out = {}
    for prefix, m in model.named_modules():
        if isinstance(m, StackedDecoderLayers):
            prefix = ".".join(part for part in prefix.split(".") if part != "_orig_module")
            for name, t in m.stacked_tensors().items():
                for row, i in enumerate(m.scanned_layers):   # layers before start are not stacked
                    out[f"{prefix}.{i}.{name}"] = (t, row)
    return out


def _check_stacked_layer(t, stacked, index, mesh):
    """A layer tensor of a scanned stack: the stack is sharded as the layer's plan with the layer
    axis unsplit, and each device's shard of this layer is the planned shard."""
    from AutoXLA import backend
    from torch_xla.distributed.spmd import XLAShardedTensor

    actual = backend.sharding_spec(stacked)
    if all(a is None for a in t.spec):
        assert actual in ("{replicated}", ""), f"{t.name}: planned replicated, stack is {actual}"
    else:
        expected = reference_sharding_string((stacked.shape[0], *t.shape), (None, *t.spec), id(mesh))
        assert actual == expected, f"{t.name}: planned {t.spec_str}, stack is {actual}"
    full = stacked.detach().cpu()
    for shard in XLAShardedTensor(stacked.detach()).local_shards:
        assert tuple(shard.data.shape[1:]) == tuple(t.shard_shape), (
            f"{t.name}: shard shape {tuple(shard.data.shape[1:])} != planned {t.shard_shape}")
        idx = shard.indices if shard.indices is Ellipsis else tuple(shard.indices)
        assert torch.equal(shard.data[index], full[idx][index]), f"{t.name}: shard data misplaced"
    return 1


def _unwrapped_named_parameters(module):
    """Parameter names as the plan states them: FSDPv2 wrappers add `_orig_module.` to the path."""
    for name, p in module.named_parameters(remove_duplicate=False):
        yield name.replace("_orig_module.", ""), p
    for name, b in module.named_buffers(remove_duplicate=False):
        yield name.replace("_orig_module.", ""), b


def embeds_and_q_proj_grads(m, ids, mask, weights, dev):
    """Gradients of a weighted sum of every valid logit with respect to the input embeddings
    and layer 0's q_proj weight (a scanned stack's layer 0 is row 0 of its stacked tensor)."""
    embeds = m.get_input_embeddings()(ids.to(dev)).detach().requires_grad_(True)
    scanned = hasattr(m.model.layers, "stacked_tensors")
    attn = (m.model.layers.stacked_tensors()["self_attn.q_proj.weight"] if scanned
            else m.model.layers[0].self_attn.q_proj.weight)
    m.zero_grad(set_to_none=True)
    logits = m(inputs_embeds=embeds, attention_mask=mask.to(dev)).logits
    loss = (logits * weights.to(dev)).sum()
    g_embeds, g_attn = torch.autograd.grad(loss, [embeds, attn])
    return g_embeds.cpu(), (g_attn[0] if scanned else g_attn).cpu()


def quiet(fn, *args, **kwargs):
    """fn(*args, **kwargs) with warnings silenced (use_pallas off a TPU, W8A8 on the fallback...)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# Logits SQNR floors against the float model (dB), for the tiny fixtures (tests/quantization/
# test_quantized_loading.py, tests/modeling/test_architectures.py). int8 per-channel: the issue's
# 25 dB (measured ~30 dB on the llama fixture). int4: the issue asks 12 dB for blockwise (64), which this fixture cannot
# give with any 4-bit round-to-nearest format: its weights are widened to std 0.2 (tiny.py) so that
# every one of its 14 linears is as large as the residual stream, and each adds its own ~20 dB
# weight noise (4 bits on Gaussian blocks), so the logits land near 20 - 10*log10(14) ~ 8.5 dB, less
# through softmax sharpening: measured 5.7-6.3 dB. The floor below is set under that and the
# format's own quality is pinned separately (test_int4_weight_and_layer_quality).
SQNR_FLOOR_DB = {8: 25.0, 4: 4.5}


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """10 log10(sum ref^2 / sum (ref - out)^2), in float64."""
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


# The first lines of a script run in a fresh interpreter that must never import torch_xla (the
# planning commands): any attempt raises, so the test fails naming it.
REFUSE_TORCH_XLA = r"""
import sys
class _NoXLA:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch_xla":
            raise ImportError("this command must not import torch_xla")
sys.meta_path.insert(0, _NoXLA())
"""


def generate_on_device(model, ids, mask, **kwargs):
    """``model.generate`` on the XLA device with CPU ``ids`` and ``mask``; the tokens on the CPU."""
    from AutoXLA import backend

    dev = backend.device()
    return model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **kwargs).cpu()


def assert_greedy_like(reference, model, ids, mask, what: str, new_tokens: int = 6) -> None:
    """``model.generate``'s greedy tokens equal transformers' ``reference`` on the same padded
    rows (no EOS, so every row runs ``new_tokens``)."""
    from AutoXLA import backend

    args = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = reference.generate(input_ids=ids, attention_mask=mask, **args)
    dev = backend.device()
    got = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args).cpu()
    assert torch.equal(got, expected), f"{what}: {got.tolist()}"


def left_padded_training_batch():
    """(ids, mask, labels): a full row and a row with 3 left pads, the pads' labels masked. The
    last pad predicts the first real token, so a pad row's attention output is in the loss."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
                        [0, 0, 0, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    mask = (ids != 0).long()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def eager_loss_and_q_proj_grad(reference, ids, mask, labels):
    """transformers' (eager) loss on the batch and d loss / d layer 0's q_proj weight, leaving
    the shared reference model without gradients for the tests after."""
    reference.zero_grad(set_to_none=True)
    loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grad = reference.model.layers[0].self_attn.q_proj.weight.grad
    reference.zero_grad(set_to_none=True)
    return loss.detach(), grad


def seed_lora_adapters(model) -> None:
    """Every peft LoRA adapter weight of ``model`` set to values seeded by its name from the
    decoder layers down, so that two models wrapped alike (AutoXLA's and plain transformers')
    start from the same adapters: peft starts B at zero (the first loss would not see them) and
    draws A from the global generator. A DTensor adapter (the dtensor runtime's, once placed by
    shard_adapters) gets its piece of the same values."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                key = name.split("layers.", 1)[-1]      # lm_head: the whole name
                g = torch.Generator().manual_seed(sum(map(ord, key)))
                value = (0.02 * torch.randn(p.shape, generator=g)).to(p.device)
                if isinstance(p, DTensor):
                    value = distribute_tensor(value, p.device_mesh, p.placements)
                p.copy_(value)


def saved_by_first_layer(decoder, hidden: int, dtype, b: int = 2, s: int = 16) -> int:
    """Bytes of every storage autograd saves while ``decoder``'s first layer runs forward on a
    random [b, s, hidden] input (saved_tensors_hooks), its weights and the shared rotary cos/sin
    excluded: what the memory forecast's per-layer activations are checked against."""
    x = torch.randn(b, s, hidden, dtype=dtype, requires_grad=True)
    pos = torch.arange(s)[None].expand(b, s)
    cos_sin = decoder.rotary_emb(x, pos)
    skip = {t.untyped_storage().data_ptr() for t in [*decoder.parameters(), *cos_sin]}
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decoder.layers[0](x, position_embeddings=cos_sin, attention_mask=None, position_ids=pos)
    return sum(n for ptr, n in seen.items() if ptr not in skip)


def arithmetic_chat(n: int) -> list[dict]:
    """``n`` chat records, "What is a plus b?" answered "a plus b is c.": a small task a tiny
    model learns in a few steps (the fine-tuning tests)."""
    records = []
    for i in range(n):
        a, b = i % 7 + 1, i % 5 + 2
        records.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                     {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
    return records


def wait_for_lines(proc, path, lines: int, timeout: float = 600) -> None:
    """Wait until ``path`` (a run's metrics.jsonl) has ``lines`` lines while ``proc`` runs; fails
    if the run ends first (there would be nothing to kill)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
