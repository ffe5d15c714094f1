"""The Pallas int8 matmul kernel (torch_xla's, interpreted) behind QuantizedLinear's pallas
backend, in a sharded model, against the backends that compute the same product another way:
int8 and int4 weight-only against the dequantize+matmul fallback, W8A8 against torch_xla's XLA
quantized matmul (which quantizes activations per row the same way)."""
import pytest
import torch

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.quantization import QuantizationConfig
from tests.helpers import assert_close

CASES = {
    # The kernel multiplies the same int8 weights in fp32 and scales after: equal to the
    # fallback's dequantized matmul up to fp32 reassociation (~1e-6 per product), so the
    # project's 1e-4 logits tolerance holds with room.
    "int8": (dict(bits=8), dict(backend="fallback"), 1e-4),
    "int4": (dict(bits=4, block_size=-1), dict(backend="fallback"), 1e-4),
    # Both sides round each activation row to int8 by its absolute maximum; a value on a
    # rounding boundary may land one step apart (1/127 of the row's maximum), which moves a
    # logit by ~1e-3 of its scale: 2e-3.
    "w8a8": (dict(bits=8, quantize_activation=True), dict(backend="xla_op"), 2e-3),
}


@pytest.fixture
def kernel_calls(monkeypatch):
    calls, real = [], backend.pallas_quantized_matmul

    def spy(x, w, scale, **kwargs):
        calls.append((tuple(x.shape), tuple(w.shape), kwargs["quantize_activation"]))
        return real(x, w, scale, **kwargs)
    monkeypatch.setattr(backend, "pallas_quantized_matmul", spy)
    return calls


def _logits(path, strategy, scan_layers=True, **quant):
    model = AutoXLAModelForCausalLM.from_pretrained(
        path, sharding_strategy=strategy, do_quant=True, scan_layers=scan_layers,
        quantization_config=QuantizationConfig(**quant))
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model, model(input_ids=ids.to(backend.device())).logits.cpu()


# Every format under fsdp; int8 also under 2d, where outputs split over the model axis too.
@pytest.mark.parametrize("case,strategy", [("int8", "fsdp"), ("int4", "fsdp"), ("w8a8", "fsdp"),
                                           ("int8", "2d")])
def test_pallas_kernel_equals_the_other_backend(case, strategy, checkpoints, kernel_calls,
                                                xla_devices):
    quant, other, atol = CASES[case]
    model, got = _logits(checkpoints["llama"], strategy, use_pallas=True, **quant)
    report = model.autoxla_quantization
    assert {d.backend for d in report.layers.values()} == {"pallas"}, str(report)
    # A scanned stack traces its body once: every projection of one layer, plus any unstacked.
    assert kernel_calls and {act for _, _, act in kernel_calls} == {case == "w8a8"}
    _, expected = _logits(checkpoints["llama"], strategy, **quant, **other)
    assert_close(got, expected, atol, 1e-4, f"{case}/{strategy} pallas vs {other['backend']}")


_UNROLLED_REFERENCE = {}


# Issue 43: with scan_layers=False every layer's weight is a parameter's own device buffer, and
# annotating it for the kernel's manual-sharding region raised "Existing annotation must be
# cleared first" (a scanned stack passes slices of its stacked tensors, graph nodes). mp adds
# buffers the plan replicates (q/k/v/o_proj: 4 heads and 2 kv heads on model=8) but the kernel
# splits by output rows: the same annotation re-laid those out through the host, silently
# unplanning them, so every tensor's sharding is checked against the plan after the forward.
@pytest.mark.parametrize("case,strategy", [("int8", "fsdp"), ("int8", "2d"), ("w8a8", "fsdp"),
                                           ("w8a8", "2d"), ("int8", "mp")])
def test_pallas_kernel_in_the_unrolled_stack(case, strategy, checkpoints, kernel_calls,
                                             xla_devices):
    from tests.helpers import check_sharding_matches_plan

    quant, other, atol = CASES[case]
    model, got = _logits(checkpoints["llama"], strategy, scan_layers=False, use_pallas=True,
                         **quant)
    assert not model.autoxla_plan.stack.scanned
    report = model.autoxla_quantization
    assert {d.backend for d in report.layers.values()} == {"pallas"}, str(report)
    # Unrolled: one call per projection of every layer (7 per Llama layer).
    assert len(kernel_calls) == 7 * model.config.num_hidden_layers
    check_sharding_matches_plan(model, model.autoxla_plan, model.autoxla_mesh)
    # The other backend's logits do not depend on the strategy (the sharded programs agree
    # within tests/helpers.py's 1e-4, far inside each case's tolerance): computed once per case,
    # unrolled under fsdp.
    if case not in _UNROLLED_REFERENCE:
        _UNROLLED_REFERENCE[case] = _logits(checkpoints["llama"], "fsdp", scan_layers=False,
                                            **quant, **other)[1]
    assert_close(got, _UNROLLED_REFERENCE[case], atol, 1e-4,
                 f"{case}/{strategy} unrolled pallas vs {other['backend']}")
