"""save_pretrained of quantized (and sharded) models: exact round trip, and atomic on a kill."""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.quantization import QuantizationConfig

CFG = QuantizationConfig(n_bits=4, block_size=64, symmetric=False, scale_search=False)  # version 1


def _load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoXLAModelForCausalLM.from_pretrained(path, **kw)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids.to(backend.device())).logits.cpu()


@pytest.fixture(scope="module")
def ids():
    return torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10]])


@pytest.mark.parametrize("strategy", ["2d", "fsdp"])
def test_save_and_load_gives_identical_logits(strategy, checkpoints, ids, tmp_path, xla_devices):
    model = _load(checkpoints["llama"], sharding_strategy=strategy, do_quant=True,
                  quantization_config=CFG, use_fsdp_wrap=strategy == "fsdp")
    before = _logits(model, ids)
    model.save_pretrained(tmp_path / "q", max_shard_size="20KB")
    files = sorted(os.listdir(tmp_path / "q"))
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert not [f for f in files if "tmp" in f or "previous" in f], files
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "autoxla" and saved["format_version"] == 1
    assert QuantizationConfig.from_dict(saved) == CFG

    again = _load(tmp_path / "q", sharding_strategy=strategy, use_fsdp_wrap=strategy == "fsdp")
    # The stored tensors are loaded as they are (int4 packed, never quantized again).
    assert "quantize" not in str(again.autoxla_quantization.warnings)
    assert torch.equal(_logits(again, ids), before)
    # Same quantization asked again is fine; a different format is refused.
    _load(tmp_path / "q", do_quant=True, quantization_config=CFG)
    with pytest.raises(ValueError, match="already quantized .* cannot be quantized again"):
        _load(tmp_path / "q", do_quant=True, quantization_config=QuantizationConfig(n_bits=8))


def test_save_into_a_file_path_is_refused(checkpoints, tmp_path, xla_devices):
    model = _load(checkpoints["llama"], do_quant=True)
    (tmp_path / "f").write_text("user data")
    with pytest.raises(ValueError, match="is a file; pass a directory"):
        model.save_pretrained(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "user data"


# A save killed at any point must leave a directory that does not load, or loads the previous
# checkpoint or the new one completely; never a mixture, and never a lost file that is not ours. The child process
# stands in for a kill with os._exit (no cleanup runs) at the n-th rename of the commit, or in the
# middle of writing a weight file.
_CHILD = textwrap.dedent("""
    import os, sys, warnings
    import torch
    warnings.simplefilter("ignore")
    mode, n, src, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from transformers import AutoModelForCausalLM
    from AutoXLA import saving
    from AutoXLA.quantization import ModelQuantizer, QuantizationConfig
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ModelQuantizer(QuantizationConfig.from_dict(%r)).quantize_model(model)
    calls = [0]
    if mode == "rename":
        real = os.replace
        def replace(a, b):
            calls[0] += 1
            if calls[0] == n:
                os._exit(9)
            real(a, b)
        os.replace = replace
    elif mode == "write":
        import safetensors.torch as st
        def save_file(tensors, path, metadata=None):
            calls[0] += 1
            if calls[0] == n:
                with open(path, "wb") as f:
                    f.write(b"\\x10" * 100)        # a torn write
                os._exit(9)
            real_save(tensors, path, metadata=metadata)
        real_save = st.save_file
        st.save_file = save_file
    saving.save_pretrained(model, out, max_shard_size="20KB")
""" % (CFG.to_dict(),))


def _run_child(mode, n, src, out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", _CHILD, mode, str(n), str(src), str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 9), r.stderr[-2000:]
    return r.returncode == 9


def test_killed_save_never_leaves_a_loadable_mixture(checkpoints, ids, tmp_path, xla_devices):
    good = tmp_path / "good"
    _run_child("none", 0, checkpoints["llama"], good)
    expected = _logits(_load(good), ids)
    previous = _load(checkpoints["llama"])     # the float model, saved before each killed save
    expected_previous = _logits(previous, ids)
    n_renames = len(os.listdir(good)) + 1    # each file renamed in, plus the old config aside
    # Before the commit, in the middle of the weight files (config.json moved aside), not at
    # all; and in the middle of a file write. One of each outcome: the kill points in between are
    # tests/loading/test_save_safety.py's, about 9 per transition.
    renames = sorted({1, n_renames // 2, n_renames + 1})
    points = [("rename", n) for n in renames] + [("write", 1)]
    outcomes = []
    for mode, n in points:
        target = tmp_path / f"{mode}{n}"
        previous.save_pretrained(target, max_shard_size="30KB")
        (target / "tokenizer.json").write_text("{}")
        killed = _run_child(mode, n, checkpoints["llama"], target)
        assert (target / "tokenizer.json").read_text() == "{}", "a file that is not ours changed"
        try:
            model = _load(target)
        except Exception:   # no config.json: refused as a checkpoint, which is the point
            assert killed and not (target / "config.json").exists()
            assert (target / "config.json.autoxla-previous").exists()   # the old config is kept
            outcomes.append("refused")
            continue
        got = _logits(model, ids)
        if torch.equal(got, expected):
            outcomes.append("new")
        else:
            assert killed and torch.equal(got, expected_previous), f"{mode} {n}: a mixture loaded"
            outcomes.append("previous")
    # Every kind of outcome happened: killed before the commit, during it, and not at all.
    assert {"previous", "refused", "new"} <= set(outcomes), outcomes
