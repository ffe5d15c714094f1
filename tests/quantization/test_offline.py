"""`autoxla quantize`: the offline quantizer writes exactly what quantizing at load time and
save_pretrained write, without XLA, in bounded memory; bad input is one clear line."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from AutoXLA import backend, saving
from AutoXLA.cli import main
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.quantization import QuantizationConfig
from AutoXLA.modeling.offline import quantize_checkpoint

CONFIGS = {
    "int4-search": QuantizationConfig(n_bits=4),      # block 32, searched scales: format 3
    "int8-asym-float-offset-f16": QuantizationConfig(
        n_bits=8, block_size=48, symmetric=False, zero_point="float", scale_dtype="float16",
        quantize_lm_head=True, quantize_embeddings=True, exclude_layers=["layers.1.mlp"]),
}
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10]])

# Prints the command's exit code, whether torch_xla was imported, and the peak RSS (VmHWM).
_WRAPPER = """
import json, sys
from AutoXLA.cli import main
rc = main(sys.argv[1:])
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"rc": rc, "xla": "torch_xla" in sys.modules, "hwm": hwm * 1024}))
"""


def _load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="2d", **kw)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS.to(backend.device())).logits.cpu()


def _files(d):
    return {f: (d / f).read_bytes() for f in sorted(os.listdir(d))}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A shrunk Mixtral in the hub's layout (one tensor per expert), from its config class."""
    from AutoXLA.testing.architectures import save_checkpoint

    return save_checkpoint("Mixtral", tmp_path_factory.mktemp("mixtral"))


# A mixture-of-experts checkpoint in the hub's layout: its experts are stacked and quantized
# (quantization/experts.py) the same way offline and at load.
CASES = [("llama", name) for name in CONFIGS] + [("mixtral", "int4-search")]


@pytest.mark.parametrize("source,name", CASES)
def test_offline_equals_quantizing_at_load_time(source, name, checkpoints, mixtral, tmp_path,
                                                xla_devices):
    cfg = CONFIGS[name]
    src = mixtral if source == "mixtral" else checkpoints[source]
    at_load = _load(src, do_quant=True, quantization_config=cfg)
    at_load.save_pretrained(tmp_path / "saved", max_shard_size="20KB")
    out = quantize_checkpoint(src, tmp_path / "offline", cfg,
                              max_shard_size="20KB", progress=False)
    # Every file, byte for byte: config.json (quantization_config, format_version), the index,
    # the shards (the same tensors in the same files at the same offsets).
    saved, offline = _files(tmp_path / "saved"), _files(out)
    assert list(offline) == list(saved) and len([f for f in saved if "-of-" in f]) > 1
    for f in saved:
        assert offline[f] == saved[f], f
    # Each stored tensor equals the one the load-time-quantized model holds.
    from safetensors import safe_open

    held = saving.saved_tensors(saving.unwrap(at_load))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(held)
    for n, f in index.items():
        with safe_open(out / f, "pt") as s:
            t = s.get_tensor(n)
        assert t.dtype == held[n].dtype and torch.equal(t, held[n].cpu()), n
    # DST loads as it is (no quantization asked) and gives the same logits exactly.
    again = _load(out)
    assert again.autoxla_quantization.config == cfg
    assert torch.equal(_logits(again), _logits(at_load))


def _run(*argv, env=None):
    r = subprocess.run([sys.executable, "-c", _WRAPPER, *map(str, argv)], capture_output=True,
                       text=True, timeout=300, env=env)
    return r, (json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None)


def test_streams_in_bounded_memory_without_xla(tmp_path):
    from AutoXLA.testing.tiny import save_tiny_checkpoint

    # Multi-shard, with 8 MiB float32 MLP weights (64 x 32768): large enough to see in the peak
    # RSS, which the tiny fixture (64 KiB tensors) is not.
    big = save_tiny_checkpoint("llama", tmp_path / "big", intermediate_size=32768,
                               max_shard_size="10MB")
    small = save_tiny_checkpoint("llama", tmp_path / "small")
    # The baseline: the same command on the same architecture with 64 KiB tensors (the same
    # imports, empty model and plan), measured the same way.
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE",)}
    r0, base = _run("quantize", small, tmp_path / "q0", "--bits", "4", "--quiet", env=env)
    r1, peak = _run("quantize", big, tmp_path / "q1", "--bits", "4", "--quiet", env=env)
    assert base and peak, (r0.stderr, r1.stderr)
    assert base["rc"] == peak["rc"] == 0
    assert not base["xla"] and not peak["xla"]          # no XLA runtime, no PJRT device needed
    largest = 64 * 32768 * 4
    total = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    assert total > 6 * largest
    # Within two tensors of the largest: one float weight read whole and its quantized outputs
    # (int4 + scales: 1/7 of it) are alive at once; 4 MiB covers malloc's arena and page rounding
    # and the run-to-run jitter of the interpreter's own peak (about 1 MiB, measured). Holding a
    # whole shard set (48 MiB of MLP weights) would fail this.
    grew = peak["hwm"] - base["hwm"]
    print(f"peak RSS {peak['hwm'] / 2**20:.1f} MiB, baseline {base['hwm'] / 2**20:.1f} MiB, grew "
          f"{grew / 2**20:.1f} MiB; largest tensor {largest / 2**20:.0f} MiB")
    assert grew <= 2 * largest + 4 * 2**20, (peak, base)


def test_bad_input_is_one_line(checkpoints, tmp_path, capsys):
    src = checkpoints["llama"]

    def err(*argv):
        assert main(["quantize", *map(str, argv)]) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith("autoxla: error: ") and "\n" not in line, line
        return line

    assert "is not a directory" in err(tmp_path / "missing", tmp_path / "d", "--bits", "8")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in err(tmp_path / "empty", tmp_path / "d", "--bits", "8")
    assert "invalid choice: 3" in err(src, tmp_path / "d", "--bits", "3")
    assert "--bits" in err(src, tmp_path / "d")
    assert "is SRC" in err(src, src, "--bits", "8")
    assert "add --asym" in err(src, tmp_path / "d", "--bits", "8", "--zero-point", "float")
    assert "block_size=0" in err(src, tmp_path / "d", "--bits", "8", "--block-size", "0")
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    assert "not empty; pass --overwrite" in err(src, user, "--bits", "8")
    assert (user / "notes.txt").read_text() == "mine" and len(os.listdir(user)) == 1
    (tmp_path / "file").write_text("x")
    assert "is a file" in err(src, tmp_path / "file", "--bits", "8")
    # Quantized output as SRC; --overwrite replaces only the checkpoint, keeps the user's file.
    assert main(["quantize", str(src), str(user), "--bits", "8", "--quiet", "--overwrite"]) == 0
    assert (user / "notes.txt").read_text() == "mine" and "quantized" in capsys.readouterr().err
    assert "already quantized" in err(user, tmp_path / "d2", "--bits", "4")
    assert not (tmp_path / "d").exists() and not (tmp_path / "d2").exists()


def test_a_failure_midway_leaves_no_checkpoint(checkpoints, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "nan"
    shutil.copytree(checkpoints["llama"], src)
    name = "model.layers.1.mlp.down_proj.weight"      # late: earlier tensors are written by then
    shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name][3, 5] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    dst = tmp_path / "dst"
    assert main(["quantize", str(src), str(dst), "--bits", "8", "--quiet"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("autoxla: error: cannot quantize model.layers.1.mlp.down_proj") and "\n" not in line
    # The journaled save rolled back: no config.json, no shard, no temporary, no journal.
    assert os.listdir(dst) == []
