"""A script written the original AutoXLA's way runs as written: its module names, its mesh, its
keywords and defaults, its optimizer wrapper and its checkpoint helper, against a local tiny
checkpoint. Numbers are checked against plain transformers on the CPU (fp32)."""
import warnings

import numpy as np
import torch

from ..helpers import assert_close


def test_training_script_written_for_the_original(checkpoints, reference_models, tmp_path,
                                                  xla_devices):
    path = str(checkpoints["llama"])
    # Unpadded rows: a padded query row's logits are undefined (each implementation fills them
    # its own way) and a causal LM's loss reads the logits of every position but the last.
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
                        [3, 4, 5, 6, 7, 8, 9, 10, 11, 40, 41, 42]])
    mask = torch.ones_like(ids)
    # --- the original's way ---
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from AutoXLA.models import AutoXLAModelForCausalLM
    from AutoXLA.optim import Lion, XLAOptimizerWrapper
    from AutoXLA.utils import prepare_model_for_checkpoint

    num_devices = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(num_devices), (4, 2), ("fsdp", "model"))   # its "2d" mesh
    sa_blocks = {"sa_block_q": 4, "sa_block_kv": 4, "AttentionType_LOCAL_SLIDING": False,
                 "mesh": str(mesh)}
    model = AutoXLAModelForCausalLM.from_pretrained(
        path, auto_shard=True, sharding_strategy="2d", gradient_checkpointing=True,
        use_fsdp_wrap=True, verbose=False, mesh=mesh, attn_implementation="Splash_Attention",
        attention_config=sa_blocks, attention_layer_indices=[0, 1],
        attention_partition_spec=("fsdp", "mp"))
    optimizer = XLAOptimizerWrapper(Lion(model.parameters(), lr=1e-3))
    dev = torch_xla.device()
    model.train()
    losses = []
    for _ in range(3):
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), labels=ids.to(dev))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    model.eval()
    plain = prepare_model_for_checkpoint(model)
    plain.save_pretrained(tmp_path / "trained")
    # --- end of the original's way ---
    assert losses[-1] < losses[0], losses
    # The first step's loss is transformers' on the same weights.
    ref = reference_models("llama")
    expected_loss = ref(input_ids=ids, attention_mask=mask, labels=ids).loss
    assert abs(losses[0] - expected_loss.item()) < 1e-4, (losses[0], expected_loss.item())
    # The trained weights came back whole: transformers reloads them, and its logits equal the
    # trained sharded model's.
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float32)
    with torch.no_grad():
        got = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()
        want = reloaded(input_ids=ids, attention_mask=mask).logits
    assert_close(got, want, what="trained model vs its reloaded checkpoint")
    assert not torch.allclose(want, ref(input_ids=ids, attention_mask=mask).logits)   # it trained


def test_quantization_script_written_for_the_original(checkpoints, reference_models, batch,
                                                      xla_devices):
    path = str(checkpoints["llama"])
    ids, mask = batch
    from AutoXLA import backend
    from AutoXLA.models import AutoXLAModelForCausalLM
    from AutoXLA.quantization import LanguageModelQuantizer, QuantizationConfig

    # Every keyword of the original's QuantizationConfig, at its own defaults but use_pallas.
    cfg = QuantizationConfig(n_bits=8, block_size=-1, symmetric=True, quantize_activation=False,
                             use_pallas=True, per_channel=True, quantize_embeddings=False,
                             quantize_lm_head=False, auto_tune_block_sizes=True, pack_4bit=True,
                             use_xla_kernel=True, exclude_layers=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # use_pallas off a TPU: said in the report
        model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="fsdp",
                                                        do_quant=True, quantization_config=cfg)
    sizes = LanguageModelQuantizer.get_model_size(model)
    assert set(sizes) >= {"param_size_mb", "buffer_size_mb", "total_size_mb"}
    dev = backend.device()
    with torch.no_grad():
        got = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()
        want = reference_models("llama")(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    # int8 per-channel: >= 25 dB logits SQNR against the float model, the floor
    # tests/quantization/test_quantized_loading.py justifies.
    err = (got[valid] - want[valid]).double()
    sqnr = 10 * torch.log10(want[valid].double().pow(2).mean() / err.pow(2).mean())
    assert sqnr >= 25, float(sqnr)
