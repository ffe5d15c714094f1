"""torch_xla.device() (or an XLA tensor) before from_pretrained: one clear error, never a crash.

torch_xla fixes what the "xla" device means the first time it hands one out; SPMD turned on after
that leaves new tensors on a physical device and the first sharded program dies with SIGSEGV
(pytorch/xla#9735). Each order runs in a fresh interpreter, since the state lasts the process.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
IDS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]

CHILD = """
import sys
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

{before}
from AutoXLA.modeling import AutoXLAModelForCausalLM
model = AutoXLAModelForCausalLM.from_pretrained(sys.argv[1], sharding_strategy="fsdp")
print("loaded", flush=True)
ids = torch.tensor({ids}).to(torch_xla.device())
with torch.no_grad():
    logits = model(input_ids=ids).logits.cpu()
torch.save(logits, sys.argv[2])
print("forward done", flush=True)
"""


def _run(before: str, checkpoint, out, env_spmd: bool = False):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_SPMD", "XLA_AUTO_SPMD")}
    # This process turned SPMD on, which set XLA_USE_SPMD=1 in its environment: the children
    # must start without it unless the test asks for it.
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    if env_spmd:
        env["XLA_USE_SPMD"] = "1"
    code = CHILD.format(before=before, ids=IDS)
    r = subprocess.run([sys.executable, "-c", code, str(checkpoint), str(out)], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    # A negative return code is a signal (SIGSEGV = -11): the crash this guards against.
    assert r.returncode >= 0, f"killed by signal {-r.returncode}:\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def normal_order_logits(checkpoints, xla_devices):
    """Logits of the usual order (model first), in this process, where SPMD is on already: the
    detection must not misfire here."""
    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], sharding_strategy="fsdp")
    backend.ensure_spmd()                       # again, with the model loaded: still fine
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS).to(backend.device())).logits.cpu()


ORDERING_ERRORS = {
    # The device handed out before SPMD: caught before use_spmd() is even tried.
    "device_first": ("torch_xla.device()", "was already in use without SPMD"),
    "xla_tensor_first": ("torch.ones(2, device='xla') + 1", "was already in use without SPMD"),
    # The user's own use_spmd() came after the device: SPMD is nominally on, the device is not.
    "use_spmd_after_device": ("torch_xla.device(); xr.use_spmd()",
                              "is the physical device CPU:0, not the SPMD virtual device"),
}


@pytest.mark.parametrize("case", list(ORDERING_ERRORS))
def test_device_before_spmd_is_one_named_error_at_load(case, checkpoints, tmp_path):
    before, what = ORDERING_ERRORS[case]
    r = _run(before, checkpoints["llama"], tmp_path / "logits.pt")
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("AutoXLA.backend.SPMDOrderError: "), r.stderr[-3000:]
    assert what in last
    # The message says what to do instead; each of these is checked to work below.
    for fix in ("AutoXLA.backend.device()", "torch_xla.runtime.use_spmd()", "XLA_USE_SPMD=1",
                "load the model first", "pytorch/xla#9735"):
        assert fix in last, fix
    # Raised by from_pretrained, before any weight reached a device or anything ran.
    assert "loaded" not in r.stdout
    assert "in from_pretrained" in r.stderr
    assert not (tmp_path / "logits.pt").exists()


WORKING_ORDERS = {
    "user_use_spmd_first": ("xr.use_spmd()\ntorch_xla.device()", False),
    "xla_use_spmd_env": ("torch_xla.device()\ntorch.ones(2, device='xla') + 1", True),
    "autoxla_device_first": ("from AutoXLA import backend\nbackend.device()\n"
                             "torch_xla.device()\ntorch.ones(2, device='xla') + 1", False),
    # Asking how many devices there are, or of which type, does not fix the device: harmless.
    "device_count_first": ("xr.global_runtime_device_count(); xr.world_size(); "
                           "xr.device_type(); torch_xla.device_count()", False),
}


@pytest.mark.parametrize("case", list(WORKING_ORDERS))
def test_orders_that_start_spmd_in_time_give_the_usual_logits(case, checkpoints, tmp_path,
                                                               normal_order_logits):
    before, env_spmd = WORKING_ORDERS[case]
    out = tmp_path / "logits.pt"
    r = _run(before, checkpoints["llama"], out, env_spmd=env_spmd)
    assert r.returncode == 0 and "forward done" in r.stdout, r.stderr[-3000:]
    logits = torch.load(out)
    assert logits.shape == (2, len(IDS[0]), 256) and torch.isfinite(logits).all()
    torch.testing.assert_close(logits, normal_order_logits)
