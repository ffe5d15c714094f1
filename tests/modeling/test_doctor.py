"""`autoxla doctor`: one run in a fresh process on the 8 CPU devices, its sections and facts."""
import json
import os
import subprocess
import sys

import pytest

from AutoXLA import _native
from AutoXLA.cli import main
from AutoXLA.generation import compile_cache


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from AutoXLA.testing.tiny import save_tiny_checkpoint

    # head_dim 16, alternating sliding-window / global layers, logit soft-cap.
    return save_tiny_checkpoint("gemma2", tmp_path_factory.mktemp("doctor") / "gemma2")


def _doctor(*argv, tmp_path):
    # The cache's probe (two more runtime starts) is tested in generation/test_compile_cache.py;
    # here its remembered verdict is read, so the run starts the runtime once.
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "autoxla-selftest.json").write_text(json.dumps(
        {"key": compile_cache._runtime_key(), "works": False, "detail": "remembered"}))
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8")
    r = subprocess.run([sys.executable, "-m", "AutoXLA.cli", "doctor", *map(str, argv),
                        "--compile-cache", str(cache)], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_doctor_reports_devices_isa_and_kernels(gemma2, tmp_path):
    r = json.loads(_doctor(gemma2, "--seq", "600", "--batch", "3", "--strategy", "2d", "--json",
                           tmp_path=tmp_path))
    assert set(r) == {"versions", "native", "devices", "runtimes", "compile_cache", "mappings",
                      "attention"}
    # This environment has torch_xla (the default) and torch 2.9's torch.distributed: both
    # runtimes import; gloo on the CPU, no GPU, no torch_tpu; 2.9 is outside TorchTPU's range
    rt = r["runtimes"]
    assert rt["default"] == "xla" and rt["xla"]["why_not"] is None
    assert rt["dtensor"]["why_not"] is None
    kinds = rt["dtensor"]["device_types"]
    assert kinds["cpu"] is None and "torch_tpu is not installed" in kinds["tpu"]
    assert "outside TorchTPU's range" in rt["dtensor"]["note"]
    assert r["versions"]["torch_xla"] and r["versions"]["python"] == sys.version.split()[0]
    assert r["native"]["isa"] == _native.best_isa()
    assert r["native"]["abi_version"] == _native.ABI_VERSION
    d = r["devices"]
    assert d["ok"] and d["device_count"] == 8 and d["device_type"] == "CPU" and d["spmd"]
    assert d["pallas"].startswith("not on a TPU")
    assert r["compile_cache"] == {"directory": str(tmp_path / "cache"), "reads_back": False,
                                  "detail": "remembered"}
    a = r["attention"]
    assert a["head_dim"] == 16 and "not a multiple of the TPU's 128 lanes" in a["head_dim_note"]
    local, glob = a["layers"]            # Gemma 2: layer 0 sliding window, layer 1 global
    assert local["window"] == 6 and glob["window"] is None
    assert local["xla_flash_attention"] == "no sliding window or logit soft-cap in flash"
    assert glob["xla_flash_attention"] == "no logit soft-cap in flash"
    assert glob["splash_attention"] == "yes, padded to 1024 positions"   # 512-token blocks
    # A batch of 3 on data*fsdp = 4 is padded to whole shards for the call (attention/tpu.py),
    # so it is no reason against a kernel.
    assert "batch" not in glob["splash_attention"]


def test_doctor_text_report_and_a_kernel_that_fits(checkpoints, tmp_path):
    out = _doctor(checkpoints["llama"], "--seq", "512", tmp_path=tmp_path)
    for section in ("versions", "C core", "devices", "runtimes", "persistent compilation cache",
                    "attention kernels of"):
        assert f"\n{section}" in f"\n{out}", out
    assert f"ISA selected: {_native.best_isa()}" in out and "8 CPU device(s), SPMD on" in out
    # Llama: no window, no soft-cap, 512 fits the 512 blocks: both kernels for every layer.
    assert "layers 0-1: xla_flash_attention: yes; splash_attention: yes" in out


def test_doctor_bad_arguments(tmp_path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(["doctor", "--seq", "0"]) == 2
    assert "--seq 0: pass a positive number" in capsys.readouterr().err


def test_doctor_warns_when_the_compile_cache_can_exhaust_memory_mappings(tmp_path):
    from AutoXLA.cli import doctor

    limit = tmp_path / "max_map_count"
    limit.write_text("65530\n")                                # this machine's (Linux's default)
    # torch_xla's default cache, 2,048 programs at ~90 mappings: 184,320 > 65,530.
    m = doctor.mappings(str(limit), environ={})
    assert m["cache_size"] == 2048 and m["cache_size_source"] == "torch_xla's default"
    assert "XLA_COMPILATION_CACHE_SIZE=364" in m["warning"]     # 65530 // 180: half the limit
    assert "vm.max_map_count=368640" in m["warning"]
    # ./run's test lanes bound it to 256: 23,040 mappings, no warning.
    m = doctor.mappings(str(limit), environ={"XLA_COMPILATION_CACHE_SIZE": "256"})
    assert m["warning"] == "" and m["mappings_needed"] == 23040
    assert "256 programs (XLA_COMPILATION_CACHE_SIZE)" in m["detail"]
    # No /proc: nothing to check, no crash.
    assert doctor.mappings(str(tmp_path / "absent"))["max_map_count"] is None


def test_selftest_without_jax_is_a_user_error_saying_how_to_get_it(capsys, xla_devices):
    # Issue 43: a user who installed the package ran `autoxla doctor --selftest` and was told to
    # report a bug for a missing optional dependency.
    from AutoXLA.kernels import interpret

    if interpret.missing() is None:
        pytest.skip("JAX is importable here: the emulated kernels run (tests/tpu_emulation)")
    assert main(["doctor", "--selftest"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoxla: error: jax is not installed") and "internal error" not in err
    assert "pip install 'jax==0.7.1'" in err and "autoxla[emulation]" in err
    assert "./run emulated -m AutoXLA.cli doctor --selftest" in err
