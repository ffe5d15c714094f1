"""The main job on the embedded default model: checkpoint -> plan -> sharded load -> generate ->
check against plain transformers; then with splash attention (the Pallas kernel on a TPU, the
portable blockwise path elsewhere), checked against eager; then the same checkpoint quantized to
int8 as it loads, with its logits' SQNR against the float model. Run with `autoxla demo`."""
from __future__ import annotations

import time
from pathlib import Path

import torch

DEFAULT_FAMILY = "llama"
NEW_TOKENS = 8


def run_demo(directory, strategy: str = "2d") -> bool:
    from transformers import AutoModelForCausalLM

    from . import backend
    from .modeling import AutoXLAModelForCausalLM
    from .tiny import save_tiny_checkpoint

    path = save_tiny_checkpoint(DEFAULT_FAMILY, Path(directory) / f"tiny-{DEFAULT_FAMILY}")
    print(f"checkpoint: {path} ({len(list(path.glob('*.safetensors')))} safetensors shards)")
    t0 = time.perf_counter()
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy)
    print(model.autoxla_plan)
    print(f"loaded on {backend.device_count()} XLA devices in {time.perf_counter() - t0:.2f} s")

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 3, 4, 5, 6, 7, 8]])
    mask = (ids != 0).long()
    args = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    dev = backend.device()
    got = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args).cpu()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = reference.generate(input_ids=ids, attention_mask=mask, **args)
    print("generated (sharded):     ", got[:, ids.shape[1]:].tolist())
    print("generated (transformers):", expected[:, ids.shape[1]:].tolist())
    ok = torch.equal(got, expected)
    print("OK: sharded generation equals plain transformers" if ok else
          "MISMATCH: sharded generation differs from plain transformers")
    ok = _splash(path, strategy, got, ids, mask, args) and ok
    return _quantized(path, strategy, reference, ids, mask) and ok


def _splash(path, strategy, eager_tokens, ids, mask, args) -> bool:
    from . import backend
    from .modeling import AutoXLAModelForCausalLM

    model = AutoXLAModelForCausalLM.from_pretrained(
        path, sharding_strategy=strategy, attn_implementation="splash_attention",
        attention_config={"sa_block_q": 4, "sa_block_kv": 4})   # several blocks, some skipped
    where = "Pallas kernel" if backend.on_tpu() else "portable blockwise path"
    dev = backend.device()
    got = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args).cpu()
    ok = torch.equal(got, eager_tokens)
    print(f"OK: splash_attention ({where}) generates eager's tokens" if ok else
          f"MISMATCH: splash_attention ({where}) generation differs from eager")
    return ok


# The demo's bar for int8 per-channel (the tests' too, tests/quantization): logits SQNR >= 25 dB.
INT8_SQNR_DB = 25.0


def _quantized(path, strategy, reference, ids, mask) -> bool:
    import warnings

    from . import backend
    from .modeling import AutoXLAModelForCausalLM
    from .quantization import QuantizationConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # use_pallas off a TPU: reported in the summary below
        model = AutoXLAModelForCausalLM.from_pretrained(
            path, sharding_strategy=strategy, do_quant=True,
            quantization_config=QuantizationConfig(bits=8, use_pallas=True))
    print(model.autoxla_quantization)
    dev = backend.device()
    with torch.no_grad():
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu().double()
        ref = reference(input_ids=ids, attention_mask=mask).logits.double()
    valid = mask.bool()
    sqnr = float(10 * torch.log10(ref[valid].pow(2).sum() / (ref[valid] - out[valid]).pow(2).sum()))
    ok = sqnr >= INT8_SQNR_DB
    print(f"{'OK' if ok else 'LOW'}: int8 logits SQNR {sqnr:.1f} dB against the float model "
          f"(goal >= {INT8_SQNR_DB:.0f} dB)")
    return ok
