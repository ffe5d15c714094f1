"""Configs and command lines no model could come from: one clear error, quickly, never a traceback."""
import json
import subprocess
import sys
import time

import pytest

from AutoXLA import cli
from AutoXLA.modeling.from_config import plan_from_config
from AutoXLA.sharding import mesh

BASE = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=100)


def _config_dir(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **fields}))
    return tmp_path


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_divisors_are_exact_and_fast():
    brute = {n: [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 400)}
    assert all(mesh._divisors(n) == want for n, want in brute.items())
    t = time.perf_counter()
    for strategy in ("fsdp", "2d", "3d"):
        shape = mesh.mesh_shape_for(strategy, mesh.MAX_DEVICES)
        assert shape.num_devices == mesh.MAX_DEVICES
    assert time.perf_counter() - t < 1.0       # sqrt(2**24) steps, not 2**24
    for bad in (10**12, 0, -8, True, 8.0):
        with pytest.raises(ValueError, match="num_devices"):
            mesh.mesh_shape_for("2d", bad)


@pytest.mark.parametrize("fields, words", [
    (dict(num_attention_heads=0), "ZeroDivisionError"),
    (dict(hidden_size=-64), "hidden_size=-64 is not a size"),
    (dict(vocab_size=1.5), "vocab_size"),
    (dict(vocab_size="12"), "vocab_size"),
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
    (dict(hidden_size=66), "is not a multiple of the number of attention heads"),
    (dict(vocab_size=2**40), "vocab_size=1099511627776 is not a size"),
    (dict(intermediate_size=True), "intermediate_size"),
])
def test_impossible_configs_are_one_error_line(capsys, tmp_path, fields, words):
    rc, out, err = _run(capsys, "plan", _config_dir(tmp_path, **fields))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("autoxla: error: ")
    assert words in err and str(tmp_path) in err and "config.json" in err


def test_per_stage_sizes_are_checked_one_by_one():
    """Vision backbones (SegFormer, Swin) give a size per stage: each must be a size."""
    from transformers import SegformerConfig

    from AutoXLA.modeling.empty import check_sizes

    check_sizes(SegformerConfig())                         # [1, 2, 5, 8] heads: fine
    for heads in ([1, 2, 0, 8], [1, -2, 5, 8], []):   # (floats: transformers refuses them)
        with pytest.raises(ValueError, match=r"num_attention_heads=.* is not a size.*per stage"):
            check_sizes(SegformerConfig(num_attention_heads=heads))


def test_large_factories_go_to_meta_in_every_calling_form():
    """While the empty model is built, a tensor over 2**26 elements is made on meta however its
    size is given; small ones (computed buffers) stay real."""
    import torch

    from AutoXLA.modeling.empty import _LargeFactoriesOnMeta

    big = (2**14, 2**13)
    with _LargeFactoriesOnMeta():
        made = [torch.empty(*big), torch.empty(big), torch.zeros(size=big), torch.ones(big),
                torch.full(big, 1.0), torch.full(size=big, fill_value=1.0), torch.randn(*big)]
        small = [torch.full(size=(2, 3), fill_value=1.0), torch.empty(4), torch.arange(3)]
    assert all(t.device.type == "meta" and tuple(t.shape) == big for t in made)
    assert all(t.device.type == "cpu" for t in small)
    assert torch.equal(small[0], torch.ones(2, 3))


def test_an_enormous_vocab_is_planned_without_host_memory(tmp_path):
    """16 TB of embedding (10**9 x 4096 fp32): built on meta, so planning takes no memory."""
    import resource

    d = _config_dir(tmp_path, vocab_size=10**9, hidden_size=4096, num_attention_heads=32,
                    num_key_value_heads=32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    plan = plan_from_config(d)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    embed = next(t for t in plan if t.name == "model.embed_tokens.weight")
    assert embed.shape == (10**9, 4096)
    assert grown_kib < 512 * 1024      # far below one shard (2 TB): nothing of it was allocated


@pytest.mark.parametrize("argv, words", [
    (["plan"], "the following arguments are required: path"),
    (["plan", "x", "--devices", "abc"], "invalid int value: 'abc'"),
    (["frob"], "invalid choice: 'frob'"),
    (["plan", "/nonexistent/dir"], "/nonexistent/dir"),
    (["generate", "/nonexistent", "--prompt", "hi", "--devices", "0"], "0 virtual CPU devices"),
])
def test_usage_errors_are_one_line_exit_2(capsys, argv, words):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("autoxla: error: ")
    assert words in err


def test_huge_device_counts_answer_at_once(checkpoints):
    """Issue 12: `autoxla plan --devices 1000000000000` did not answer (a linear divisor search)."""
    for argv in (["plan", str(checkpoints["llama"]), "--devices", "1000000000000"],
                 ["plan", str(checkpoints["llama"]), "--devices", str(mesh.MAX_DEVICES),
                  "--strategy", "3d"],
                 ["generate", str(checkpoints["llama"]), "--prompt", "hi", "--devices",
                  "1000000000000"]):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "AutoXLA.cli", *argv], capture_output=True,
                           text=True, timeout=120)
        assert time.perf_counter() - t < 60
        if argv[-1] == "3d":
            assert r.returncode == 0, r.stderr
        else:
            assert r.returncode == 2 and "Traceback" not in r.stderr
            assert r.stderr.strip().splitlines()[-1].startswith("autoxla: error: ")


def test_a_bug_is_one_line_too(capsys, monkeypatch, checkpoints):
    def broken(*a, **k):
        raise ZeroDivisionError("boom")

    from AutoXLA.cli import plan as plan_cli

    monkeypatch.setattr(plan_cli, "meta_model", broken)   # what `autoxla plan` builds with
    rc, _, err = _run(capsys, "plan", checkpoints["llama"])
    assert rc == 1 and err.count("\n") == 1
    assert "internal error: ZeroDivisionError: boom" in err and "AUTOXLA_TRACEBACK=1" in err
