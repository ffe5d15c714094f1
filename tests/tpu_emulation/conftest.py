"""The emulated TPU kernels (AutoXLA/kernels/interpret.py) for every test in this folder.

Runs in its own pytest process (./run test's lane B, with requirements-tpu-emulation.lock's JAX
stack on PYTHONPATH): the switch is process-wide, and jax being importable changes torch_xla for
everything after. Without the JAX stack this folder is skipped, unless the lane that must run it
(AUTOXLA_REQUIRE_TPU_EMULATION=1) finds it missing, which is an error.
"""
import os

import pytest

from AutoXLA.kernels import interpret

_MISSING = interpret.missing()
if _MISSING and os.environ.get("AUTOXLA_REQUIRE_TPU_EMULATION") == "1":
    raise pytest.UsageError(f"the emulated TPU kernel tests must run here, but {_MISSING}")
if _MISSING:
    collect_ignore_glob = ["test_*.py"]
else:
    interpret.enable()


@pytest.fixture(autouse=True)
def _emulated():
    assert interpret.enabled()
